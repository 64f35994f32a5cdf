"""Which outer state a replica should hold, and serving its own to others.

A joiner (or a peer that fell behind) needs the run's current outer weights and outer
optimizer state. Every member publishes ``(round, hash of its outer state)`` in the replicated
state and serves the state as named tensors on the data plane, under the round they belong to
(``outer/<round>/params/<name>``, ``outer/<round>/momentum/<name>``, ``outer/<round>/meta/json``).
``agreed_round`` and ``repair_target`` decide, from those records alone and identically on every
peer, which round and hash to adopt and who holds it; the verified parallel fetch itself is
``lattica.train.swarm.join.fetch_outer_state``.

Holders move on while a joiner fetches: the published record it read may already be a round
old. ``ServedRounds`` therefore keeps the states of the last ``keep`` rounds on offer, so a
fetch of the round the joiner saw still finds the bytes that hash to the published value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lattica.crdt.documents import ProgressRecord
from lattica.train.engine.outer_state import MANIFEST, flatten_outer_state
from lattica.train.ports import TensorStore
from lattica.train.swarm.join import Fetch


def round_prefix(rnd: int) -> str:
    return f"outer/{rnd}/"


def serve_outer_state(store: TensorStore, state: Mapping[str, object], *, prefix: str = "") -> list[str]:
    """Offer ``state`` to joiners as the named tensors ``join.fetch_outer_state`` asks for
    (each name behind ``prefix``); returns the names served."""
    names = []
    for name, tensor in flatten_outer_state(state).items():
        store.serve(prefix + name, tensor.detach().clone())
        names.append(prefix + name)
    return names


class ServedRounds:
    """Our outer states of the last ``keep`` completed rounds, on offer under ``round_prefix``."""

    def __init__(self, store: TensorStore, *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"ServedRounds keep must be >= 1, got {keep}")
        self.store, self.keep = store, keep
        self._names: dict[int, list[str]] = {}

    def publish(self, rnd: int, state: Mapping[str, object]) -> None:
        for name in self._names.pop(rnd, []):
            self.store.unserve(name)
        self._names[rnd] = serve_outer_state(self.store, state, prefix=round_prefix(rnd))
        for old in sorted(self._names)[: -self.keep]:
            for name in self._names.pop(old):
                self.store.unserve(name)

    @property
    def rounds(self) -> list[int]:
        return sorted(self._names)


def fetch_of_round(fetch: Fetch, rnd: int) -> Fetch:
    """``fetch`` for the unprefixed names ``join.fetch_outer_state`` uses, served for ``rnd``."""
    prefix = round_prefix(rnd)

    async def fetch_round(peer: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        got = await fetch(peer, [prefix + n for n in names])
        return {n.removeprefix(prefix): t for n, t in got.items()}

    return fetch_round


class ProbedManifests:
    """Manifests fetched to check that a holder serves the state it published, kept for the
    fetch of that state that usually follows at once: a holder answers the same request at most
    once per ``TensorLimits.fetch_repeat_s``, so asking for the manifest again was refused — a
    peer restarted into a running swarm then failed to fetch the state it had just found served
    and trained on from its stale checkpoint. Each kept manifest answers one request."""

    def __init__(self, *, max_kept: int = 8) -> None:
        self.max_kept = max_kept
        self._kept: dict[tuple[str, int], Mapping[str, torch.Tensor]] = {}

    def keep(self, holder: str, rnd: int, manifest: Mapping[str, torch.Tensor]) -> None:
        self._kept.pop((holder, rnd), None)
        self._kept[(holder, rnd)] = manifest
        while len(self._kept) > self.max_kept:
            del self._kept[next(iter(self._kept))]

    def round_fetch(self, fetch: Fetch, rnd: int) -> Fetch:
        """``fetch_of_round(fetch, rnd)``, answering a request for the manifest alone from a kept
        probe of that holder and round (hash-verified with the rest, like any fetched bytes)."""
        plain = fetch_of_round(fetch, rnd)

        async def fetch_round(peer: str, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
            kept = self._kept.pop((peer, rnd), None) if list(names) == [MANIFEST] else None
            return kept if kept is not None else await plain(peer, names)

        return fetch_round


def _votes(progress: Mapping[str, ProgressRecord], live: Sequence[str], me: str) -> dict[tuple[int, str], list[str]]:
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


def _most_held(counts: Mapping[tuple[int, str], int]) -> tuple[int, str]:
    """The state with the most holders; ties go to the newest round, then the smallest hash,
    so every peer that sees the same records picks the same one."""
    return min(counts, key=lambda state: (-counts[state], -state[0], state[1]))


def agreed_round(
    progress: Mapping[str, ProgressRecord], live: Sequence[str], me: str,
) -> tuple[int, str, list[str]] | None:
    """The outer state most live peers hold: (round, weights hash, holders).

    Most holders, not newest round: a peer cut off from the others may have run rounds on its
    own and be "ahead"; the run's state is what the majority holds.
    """
    votes = _votes(progress, live, me)
    if not votes:
        return None
    rnd, digest = _most_held({state: len(holders) for state, holders in votes.items()})
    return rnd, digest, votes[(rnd, digest)]


def repair_target(
    progress: Mapping[str, ProgressRecord],
    live: Sequence[str],
    me: str,
    mine: tuple[int, str | None],
    history: Mapping[int, str] | None = None,
) -> tuple[int, str, list[str]] | None:
    """The state to adopt when this replica (``mine`` = completed rounds, state hash) is not on
    the state most live peers hold (``mine`` counts as one more holder); else None.

    - Behind the majority's round, or on a minority hash at the same round: adopt it.
    - Ahead of it: the others may only not have published their newest round yet. ``history``
      (this replica's own hashes of recent rounds) tells: if our hash at the majority's round was
      the majority's hash, we are ahead on the same line and keep our state; if it differs, our
      rounds since then ran apart from the run (a partition, a coordinator nobody else saw) and
      we adopt the majority's state. A round we hold no history for counts as the same line.

    Two groups that synced apart therefore re-converge on the larger one (ties: the newest
    round, then the smallest hash), identically on every peer.
    """
    votes = _votes(progress, live, me)
    if not votes:
        return None
    my_round, my_hash = mine
    counts = {state: len(holders) for state, holders in votes.items()}
    if my_hash is not None and my_round > 0:
        counts[(my_round, my_hash)] = counts.get((my_round, my_hash), 0) + 1
    rnd, digest = _most_held(counts)
    if (rnd, digest) == (my_round, my_hash):
        return None
    if rnd < my_round and (history or {}).get(rnd, digest) == digest:
        return None
    return rnd, digest, votes[(rnd, digest)]


__all__ = [
    "ProbedManifests", "ServedRounds", "agreed_round", "fetch_of_round", "repair_target", "round_prefix",
    "serve_outer_state",
]
