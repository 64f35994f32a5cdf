"""Joining a running swarm: fetch the outer state from several holders, verify, adopt.

Theory of operation
-------------------
Every strategy's ``outer_state_dict`` is a mapping whose values are either a mapping of named
tensors (``params``, ``momentum``, ``velocity`` …) or plain JSON-able data (round numbers,
SPES's expert owners). ``flatten_outer_state`` turns it into named tensors: ``<group>/<name>``
for the tensors and one ``meta/json`` byte tensor for the rest, which also lists every tensor
name — the *manifest*. Every member publishes, for its last completed round, the
``weights_hash`` of that flat form (``outer_state_hash``).

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

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError, RemoteError, RemoteProtocolError
from lattica.train.checkpoint import StateDict, weights_hash

log = logging.getLogger(__name__)

Fetch = Callable[[str, Sequence[str]], Awaitable[Mapping[str, torch.Tensor]]]
_FETCH_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)


MANIFEST = "meta/json"
_MAX_MANIFEST_BYTES = 4 << 20
_MAX_TENSORS = 100_000


def flatten_outer_state(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Named tensors of an ``outer_state_dict``, plus the ``meta/json`` manifest."""
    flat: dict[str, torch.Tensor] = {}
    meta: dict[str, object] = {}
    for key, value in state.items():
        if isinstance(value, Mapping) and value and all(isinstance(t, torch.Tensor) for t in value.values()):
            flat.update({f"{key}/{name}": t for name, t in value.items()})
        elif isinstance(value, Mapping) and not value:
            meta[key] = {}
        else:
            meta[key] = value
    meta["tensors"] = sorted(flat)
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    flat[MANIFEST] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return flat


@dataclass(frozen=True)
class Manifest:
    """The JSON part of a flat outer state: its tensors' names and its plain values."""

    names: list[str]  # "<group>/<parameter>"
    values: dict[str, object]  # every other entry of the outer state


def read_manifest(flat: Mapping[str, torch.Tensor], *, peer_id: str | None = None) -> Manifest:
    """The JSON part of a flat outer state, validated (it comes from a peer)."""
    blob = flat.get(MANIFEST)
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise RemoteProtocolError("outer state lacks its manifest", peer_id=peer_id)
    if blob.numel() > _MAX_MANIFEST_BYTES:
        raise RemoteProtocolError("outer-state manifest too large", peer_id=peer_id)
    try:
        meta: object = json.loads(bytes(blob.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RemoteProtocolError("outer-state manifest is not JSON", peer_id=peer_id) from None
    names = meta.get("tensors") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(names, list) or len(names) > _MAX_TENSORS or not all(
        isinstance(n, str) and "/" in n and n != MANIFEST and len(n) <= 512 for n in names
    ):
        raise RemoteProtocolError("outer-state manifest has a bad tensor list", peer_id=peer_id)
    values = {key: value for key, value in meta.items() if key != "tensors"}  # JSON object keys are strings
    return Manifest(names=names, values=values)


def unflatten_outer_state(flat: Mapping[str, torch.Tensor]) -> StateDict:
    """Rebuild the ``outer_state_dict`` that ``flatten_outer_state`` flattened."""
    manifest = read_manifest(flat)
    names = manifest.names
    unexpected = set(flat) - set(names) - {MANIFEST}
    if unexpected:
        raise RemoteProtocolError(f"unexpected tensor {sorted(unexpected)[0]!r} in fetched outer state")
    state: StateDict = dict(manifest.values)
    for key in names:
        group, _, name = key.partition("/")
        if key not in flat:
            raise RemoteProtocolError(f"outer state lacks tensor {key!r}")
        state.setdefault(group, {})[name] = flat[key]
    return state


def outer_state_hash(state: Mapping[str, object]) -> str:
    """The hash a member publishes so that joiners can verify the state they fetch."""
    return weights_hash(flatten_outer_state(state))


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
