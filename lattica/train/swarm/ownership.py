"""SPES expert ownership kept in the run's replicated state.

Theory of operation
-------------------
Every trainer writes the set of experts it owns into its own document of the replicated state
(``experts``: expert id -> True; ``lattica state`` shows ``experts: {id: [owner]}``). The map
advances only at a completed SPES sync, by the pure rule of ``assign_experts`` applied to the
previous map and that sync's agreed member list, so every member derives the same map without
any extra message, and then publishes its part of it:

- an owner that leaves (SIGTERM writes ``left``; a crash lets its lease expire) is not in the
  next sync's member list: its experts are copied in that sync from the lowest-id member, which
  holds the latest synced copy like every member, and go to the least-loaded survivors — each
  new owner therefore has fetched the latest copy of an expert before it trains it;
- a fresh node reads the map from the state (claims of live members; experts nobody live
  claims are assigned by the same rule), so it freezes the right experts before its first
  sync; a node that adopts the swarm's outer state takes the map that came with it.

Claims are untrusted input: one expert claimed by several live members goes to the lowest id,
unknown or out-of-range ids are ignored. Claims only inform start-up; what a sync uses is the
map every member of the previous sync holds (part of the hash-verified outer state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from lattica.train.strategies.experts import assign_experts, experts_of
from lattica.train.swarm.membership import MembershipView

log = logging.getLogger(__name__)


def claimed_owners(
    experts: Mapping[str, object], live: Sequence[str], num_experts: int
) -> dict[int, str]:
    """expert -> owner from the claims by live members (``MembershipView.expert_claims``: expert
    id -> claimants; lowest id on a conflict)."""
    owners: dict[int, str] = {}
    alive = set(live)
    for key, claimants in experts.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(claimants, list)):
            continue
        expert = int(key)
        holders = sorted(c for c in claimants if isinstance(c, str) and c in alive)
        if 0 <= expert < num_experts and holders:
            owners[expert] = holders[0]
    return owners


class ReplicatedOwnership:
    """An ``ExpertOwnership`` whose map is published in, and read from, the replicated state."""

    def __init__(
        self,
        view: MembershipView,
        *,
        num_experts: int,
        candidates: Callable[[], Sequence[str]],
    ) -> None:
        self.view = view
        self.peer_id = peer_id = view.peer_id
        self.num_experts = num_experts
        # read here, on the event-loop thread (the strategy may be built in a worker thread)
        live = sorted(set(candidates()) | {peer_id})
        claims = claimed_owners(view.expert_claims(), live, num_experts)
        self._owners = assign_experts(live, num_experts, previous=claims or None)
        self._published: list[str] | None = None

    def current(self) -> Mapping[int, str]:
        return dict(self._owners)

    def adopt(self, owners: Mapping[int, str]) -> None:
        """Take the map that came with an adopted outer state (published at the next sync)."""
        self._owners = dict(owners)

    async def for_sync(self, key: str, members: Sequence[str]) -> Mapping[int, str]:
        before = set(experts_of(self._owners, self.peer_id))
        self._owners = assign_experts(members, self.num_experts, previous=self._owners)
        gained = sorted(set(experts_of(self._owners, self.peer_id)) - before)
        if gained:
            log.info("sync %s: now owning experts %s as well", key, gained)
        await self.publish()
        return dict(self._owners)

    async def publish(self) -> None:
        """Write this node's experts into the replicated state (only when they changed)."""
        mine = [str(e) for e in experts_of(self._owners, self.peer_id)]
        if mine != self._published:
            await self.view.set_owned_experts(mine)
            self._published = mine
