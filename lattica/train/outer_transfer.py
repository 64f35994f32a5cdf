"""Moving a replica's outer state between peers: serve it, fetch it from several holders.

A joiner (or a peer that fell behind) needs the run's current outer weights and outer
optimizer state. Holders serve them as named tensors on the data plane (``params/<name>``,
``momentum/<name>`` and 0-d ``meta/<field>`` integers). The fetcher splits the names across all
holders that published the same weights hash, fetches in parallel, and accepts the result only
if the parameters hash to that published value — a lying holder cannot poison the joiner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import trio

from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.train.checkpoint import verify_weights

META_FIELDS = ("round", "step", "completed_rounds")


class TensorStore(Protocol):
    def serve(self, name: str, tensor: torch.Tensor) -> None: ...
    async def fetch(self, peer: str, names: Sequence[str]) -> dict[str, torch.Tensor]: ...


def flatten_outer_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"params/{n}": t for n, t in state["params"].items()}
    flat.update({f"momentum/{n}": t for n, t in state.get("momentum", {}).items()})
    for name in META_FIELDS:
        if name in state:
            flat[f"meta/{name}"] = torch.tensor(int(state[name]), dtype=torch.int64)
    return flat


def unflatten_outer_state(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {"params": {}, "momentum": {}}
    for key, tensor in flat.items():
        kind, _, name = key.partition("/")
        if kind in ("params", "momentum"):
            state[kind][name] = tensor
        elif kind == "meta" and name in META_FIELDS:
            state[name] = int(tensor.item())
    return state


def serve_outer_state(store: TensorStore, state: dict[str, Any]) -> None:
    for name, tensor in flatten_outer_state(state).items():
        store.serve(name, tensor.detach().clone())


async def fetch_outer_state(
    store: TensorStore, holders: Sequence[str], names: Sequence[str], expected_hash: str
) -> dict[str, Any]:
    """Fetch ``names`` spread over ``holders`` in parallel; verify against ``expected_hash``."""
    if not holders:
        raise PeerUnavailableError("no holder of the outer state is reachable")
    fetched: dict[str, torch.Tensor] = {}
    failed: list[str] = []
    assignment = {h: list(names[i :: len(holders)]) for i, h in enumerate(holders)}

    async def fetch_part(holder: str, part: list[str]) -> None:
        if not part:
            return
        try:
            fetched.update(await store.fetch(holder, part))
        except Exception:  # noqa: BLE001 - retried below from another holder
            failed.append(holder)

    async with trio.open_nursery() as nursery:
        for holder, part in assignment.items():
            nursery.start_soon(fetch_part, holder, part)
    missing = [n for n in names if n not in fetched]
    if missing:  # second chance: everything missing from the first holder that answered
        good = [h for h in holders if h not in failed]
        if not good:
            raise PeerUnavailableError(f"all {len(holders)} holders failed")
        fetched.update(await store.fetch(good[0], missing))
    state = unflatten_outer_state(fetched)
    verify_weights(state["params"], expected_hash, peer_id=",".join(holders))
    return state


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


__all__ = [
    "RemoteProtocolError",
    "agreed_round",
    "fetch_outer_state",
    "flatten_outer_state",
    "repair_target",
    "serve_outer_state",
    "unflatten_outer_state",
]
