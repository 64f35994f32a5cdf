"""Which outer state a replica should hold, and serving its own to others.

A joiner (or a peer that fell behind) needs the run's current outer weights and outer
optimizer state. Every member publishes ``(round, hash of its outer state)`` in the replicated
state and serves the state as named tensors on the data plane (``params/<name>``,
``momentum/<name>``). ``agreed_round`` and ``repair_target`` decide, from those records alone and
identically on every peer, which round and hash to adopt and who holds it; the verified parallel
fetch itself is ``lattica.train.join.fetch_outer_state``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lattica.train.join import flatten_outer_state


class TensorStore(Protocol):
    def serve(self, name: str, tensor: torch.Tensor) -> None: ...


def serve_outer_state(store: TensorStore, state: dict[str, Any]) -> None:
    """Offer ``state`` to joiners as the named tensors ``join.fetch_outer_state`` asks for."""
    for name, tensor in flatten_outer_state(state).items():
        store.serve(name, tensor.detach().clone())


def _votes(progress: dict[str, Any], live: Sequence[str], me: str) -> dict[tuple[int, str], list[str]]:
    """Live peers other than ``me`` by the (round, weights hash) they published; round 0 skipped."""
    votes: dict[tuple[int, str], list[str]] = {}
    for peer in sorted(live):
        if peer == me:
            continue
        record = progress.get(peer)
        if not isinstance(record, dict):
            continue
        rnd, digest = record.get("round"), record.get("weights_hash")
        if type(rnd) is int and isinstance(digest, str) and digest and rnd > 0:
            votes.setdefault((rnd, digest), []).append(peer)
    return votes


def _winner(votes: dict[tuple[int, str], list[str]], rnd: int, extra: str | None = None) -> str:
    """The hash of round ``rnd`` with the most holders (``extra`` counts once more); ties go to
    the smallest hash, so every peer that sees the same records picks the same one."""
    counts = {digest: len(holders) for (r, digest), holders in votes.items() if r == rnd}
    if extra is not None:
        counts[extra] = counts.get(extra, 0) + 1
    return min(counts, key=lambda digest: (-counts[digest], digest))


def agreed_round(progress: dict[str, Any], live: Sequence[str], me: str) -> tuple[int, str, list[str]] | None:
    """The newest round that most live peers agree on: (round, weights hash, holders)."""
    votes = _votes(progress, live, me)
    if not votes:
        return None
    rnd = max(r for r, _ in votes)
    digest = _winner(votes, rnd)
    return rnd, digest, votes[(rnd, digest)]


def repair_target(
    progress: dict[str, Any], live: Sequence[str], me: str, mine: tuple[int, str | None]
) -> tuple[int, str, list[str]] | None:
    """The state to adopt when this replica (``mine`` = completed rounds, weights hash) is behind
    the newest round of the others, or holds a minority hash at the same round; else None.

    Two groups that synced the same round apart (peers saw different coordinators) end with
    different weights; every peer compares its hash with the published ones and the minority
    adopts the majority's state (ties: the smallest hash), so replicas re-converge.
    """
    votes = _votes(progress, live, me)
    if not votes:
        return None
    my_round, my_hash = mine
    rnd = max(r for r, _ in votes)
    if rnd < my_round:
        return None
    digest = _winner(votes, rnd, extra=my_hash if rnd == my_round else None)
    if rnd == my_round and digest == my_hash:
        return None
    return rnd, digest, votes[(rnd, digest)]


__all__ = ["agreed_round", "repair_target", "serve_outer_state"]
