"""Who owns which expert in SPES: a pure, deterministic assignment and its source.

Every member computes the same map from the same inputs, so ownership needs no extra round of
messages: after every completed sync the map advances with
``assign_experts(members, num_experts, previous=current)`` over that sync's agreed members (the
first sync: rule 1 over its members). The daemon publishes each node's part of the map in the
replicated state (``lattica/train/swarm/ownership.py``).

Rules (in this order):
1. no previous map: sorted members take contiguous ranges, member i gets [i·k, (i+1)·k) with
   k = E / M (the first E mod M members take one more);
2. an expert whose owner is still a member keeps its owner (nobody loses training progress);
3. orphans (owner gone), lowest index first, go to the least-loaded member (ties: lowest id);
4. while loads differ by more than one, the most-loaded member (ties: highest id) hands its
   highest-numbered expert to the least-loaded (ties: lowest id) — this gives joiners work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


def assign_experts(
    members: Sequence[str], num_experts: int, *, previous: Mapping[int, str] | None = None
) -> dict[int, str]:
    """The expert -> owner map for ``members``, keeping ``previous`` owners where possible."""
    if not members:
        raise ValueError("cannot assign experts to an empty member list")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    order = sorted(set(members))
    if previous is None:
        return _contiguous(order, num_experts)
    owners = {e: o for e, o in previous.items() if o in order and 0 <= e < num_experts}
    loads = {m: 0 for m in order}
    for owner in owners.values():
        loads[owner] += 1
    for expert in range(num_experts):
        if expert not in owners:
            owners[expert] = _least_loaded(loads)
            loads[owners[expert]] += 1
    while max(loads.values()) - min(loads.values()) > 1:
        donor = max(order, key=lambda m: (loads[m], m))
        taker = _least_loaded(loads)
        moved = max(e for e, o in owners.items() if o == donor)
        owners[moved] = taker
        loads[donor] -= 1
        loads[taker] += 1
    return dict(sorted(owners.items()))


def experts_of(owners: Mapping[int, str], member: str) -> list[int]:
    return sorted(e for e, o in owners.items() if o == member)


class ExpertOwnership(Protocol):
    """Where SPES learns the agreed expert -> owner map (the daemon: the replicated state)."""

    def current(self) -> Mapping[int, str]:
        """The map in force now (used at start-up to freeze the experts this node does not own)."""
        ...

    def adopt(self, owners: Mapping[int, str]) -> None:
        """Continue from ``owners`` (the map of an adopted or restored outer state)."""
        ...

    async def for_sync(self, key: str, members: Sequence[str]) -> Mapping[int, str]:
        """The map that holds after sync ``key`` whose participants are ``members``."""
        ...


class DerivedOwnership:
    """An ``ExpertOwnership`` computed locally with ``assign_experts`` (tests, static runs).

    Every member that sees the same sequence of member lists derives the same maps.
    """

    def __init__(self, members: Sequence[str], num_experts: int) -> None:
        self.num_experts = num_experts
        self._owners = assign_experts(members, num_experts)

    def current(self) -> Mapping[int, str]:
        return dict(self._owners)

    def adopt(self, owners: Mapping[int, str]) -> None:
        self._owners = dict(owners)

    async def for_sync(self, key: str, members: Sequence[str]) -> Mapping[int, str]:
        self._owners = assign_experts(members, self.num_experts, previous=self._owners)
        return dict(self._owners)


def _contiguous(order: list[str], num_experts: int) -> dict[int, str]:
    base, extra = divmod(num_experts, len(order))
    owners: dict[int, str] = {}
    expert = 0
    for i, member in enumerate(order):
        for _ in range(base + (1 if i < extra else 0)):
            owners[expert] = member
            expert += 1
    return owners


def _least_loaded(loads: Mapping[str, int]) -> str:
    return min(loads, key=lambda m: (loads[m], m))
