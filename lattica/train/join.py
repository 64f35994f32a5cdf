"""Joining a running swarm: fetch the outer state from several holders, verify, adopt.

Theory of operation
-------------------
Every member publishes, for its last completed round, ``state_hash`` — the ``weights_hash`` of
its flattened outer state (``params/<name>`` and ``momentum/<name>`` tensors). A joiner picks
the holders that published the newest round with the same hash and calls ``fetch_outer_state``:

1. the tensor names are dealt round-robin to the holders and fetched in parallel through the
   caller's ``fetch(peer, names)`` (the data plane);
2. a holder that fails has its share re-dealt to the remaining holders;
3. the assembled state must hash to ``expected_hash``; if it does not (someone sent wrong
   bytes), every holder is tried alone, in turn, and only a state whose hash matches is
   accepted. A holder whose state mismatches is reported as a ``RemoteProtocolError``.

The result goes through ``unflatten_outer_state`` into ``Trainer.adopt_outer_state``; the
joiner takes part from the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError, RemoteError, RemoteProtocolError
from lattica.train.checkpoint import weights_hash

log = logging.getLogger(__name__)

Fetch = Callable[[str, Sequence[str]], Awaitable[Mapping[str, torch.Tensor]]]
_FETCH_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)


def flatten_outer_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``params/<name>`` and ``momentum/<name>`` tensors of an ``outer_state_dict``."""
    flat = {f"params/{n}": t for n, t in state.get("params", {}).items()}
    flat.update({f"momentum/{n}": t for n, t in state.get("momentum", {}).items()})
    return flat


def unflatten_outer_state(
    flat: Mapping[str, torch.Tensor], *, round: int, step: int, completed_rounds: int | None = None
) -> dict[str, Any]:
    state: dict[str, Any] = {"params": {}, "momentum": {}, "round": round, "step": step}
    state["completed_rounds"] = round if completed_rounds is None else completed_rounds
    for key, tensor in flat.items():
        kind, _, name = key.partition("/")
        if kind not in ("params", "momentum") or not name:
            raise RemoteProtocolError(f"unexpected tensor {key!r} in fetched outer state")
        state[kind][name] = tensor
    return state


def outer_state_hash(state: Mapping[str, Any]) -> str:
    """The hash a member publishes so that joiners can verify the state they fetch."""
    return weights_hash(flatten_outer_state(state))


async def fetch_outer_state(
    holders: Sequence[str], names: Sequence[str], fetch: Fetch, *, expected_hash: str
) -> dict[str, torch.Tensor]:
    """Fetch ``names`` from ``holders`` in parallel and return them once their hash matches."""
    if not holders:
        raise PeerUnavailableError("no peer holds the current outer state")
    try:
        parallel = await _fetch_spread(list(holders), list(names), fetch)
        if weights_hash(parallel) == expected_hash:
            return parallel
        log.warning("outer state assembled from %d holders does not match; retrying", len(holders))
    except PeerUnavailableError as exc:
        log.warning("parallel fetch failed: %s", exc)
    last: RemoteError | None = None
    for holder in holders:
        try:
            alone = await _fetch_checked(holder, list(names), fetch)
        except _FETCH_ERRORS as exc:
            last = exc
            continue
        if weights_hash(alone) == expected_hash:
            return alone
        last = RemoteProtocolError("outer state does not match the published hash", peer_id=holder)
        log.warning("%s", last)
    raise last or PeerUnavailableError("no holder served the outer state")


async def _fetch_spread(
    holders: list[str], names: list[str], fetch: Fetch
) -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = {}
    pending, alive = names, holders
    while pending:
        if not alive:
            raise PeerUnavailableError("every holder failed during the parallel fetch")
        shares = {h: pending[i :: len(alive)] for i, h in enumerate(alive)}
        failed: list[str] = []
        async with trio.open_nursery() as nursery:
            for holder, share in shares.items():
                if share:
                    nursery.start_soon(_fetch_share, holder, share, fetch, result, failed)
        alive = [h for h in alive if h not in failed]
        pending = [n for n in pending if n not in result]
    return result


async def _fetch_share(
    holder: str,
    share: list[str],
    fetch: Fetch,
    result: dict[str, torch.Tensor],
    failed: list[str],
) -> None:
    try:
        result.update(await _fetch_checked(holder, share, fetch))
    except _FETCH_ERRORS as exc:
        log.warning("holder failed: %s", exc)
        failed.append(holder)


async def _fetch_checked(holder: str, names: list[str], fetch: Fetch) -> dict[str, torch.Tensor]:
    got = await fetch(holder, names)
    if set(got) != set(names) or not all(isinstance(t, torch.Tensor) for t in got.values()):
        raise RemoteProtocolError("holder sent a different set of tensors", peer_id=holder)
    return dict(got)
