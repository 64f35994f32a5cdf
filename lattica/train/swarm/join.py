"""Joining a running swarm: fetch the outer state from several holders, verify, adopt.

Theory of operation
-------------------
Every member publishes, for its last completed round, the hash of its outer state in flat form
(``outer_state.outer_state_hash``: named tensors plus the ``meta/json`` manifest).

A joiner picks the holders that published the newest round with the same hash and calls
``fetch_outer_state``:

1. it fetches ``meta/json`` from the first holder that answers and reads the manifest;
2. the tensor names are dealt round-robin to the holders and fetched in parallel through the
   caller's ``fetch(peer, names)`` (the data plane); a holder that fails has its share re-dealt
   to the remaining holders;
3. the assembled state must hash to ``expected_hash``; if it does not (someone sent wrong
   bytes), every holder is tried alone, in turn, and only a state whose hash matches is
   accepted. A holder whose state mismatches is reported as a ``RemoteProtocolError``.

The result is held to the joiner's own outer state (``state_schema.check_outer_state``: names,
shapes, dtypes, finite values, the manifest's entries) and goes into ``Trainer.adopt_outer_state``;
the joiner takes part from the next round. Which claims are fetched at all: ``adoption.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError, RemoteError, RemoteProtocolError
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.outer_state import MANIFEST, read_manifest

log = logging.getLogger(__name__)

Fetch = Callable[[str, Sequence[str]], Awaitable[Mapping[str, torch.Tensor]]]
_FETCH_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)


async def fetch_outer_state(
    holders: Sequence[str], fetch: Fetch, *, expected_hash: str
) -> dict[str, torch.Tensor]:
    """Fetch the manifest, then its tensors from ``holders`` in parallel; verify the hash."""
    if not holders:
        raise PeerUnavailableError("no peer holds the current outer state")
    names: list[str] | None = None
    manifest: dict[str, torch.Tensor] = {}
    last: RemoteError | None = None
    for holder in holders:
        try:
            manifest = await _fetch_checked(holder, [MANIFEST], fetch)
            names = read_manifest(manifest, peer_id=holder).names
            break
        except _FETCH_ERRORS as exc:
            last = exc
    if names is None:
        raise last or PeerUnavailableError("no holder served the outer-state manifest")
    try:
        parallel = await _fetch_spread(list(holders), names, fetch)
        parallel.update(manifest)
        if weights_hash(parallel) == expected_hash:
            return parallel
        log.warning("outer state assembled from %d holders does not match; retrying", len(holders))
    except PeerUnavailableError as exc:
        log.warning("parallel fetch failed: %s", exc)
    for holder in holders:
        try:
            alone = await _fetch_checked(holder, [MANIFEST, *names], fetch)
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
