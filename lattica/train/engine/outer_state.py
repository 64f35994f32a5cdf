"""An outer state as named tensors: what members hash and publish, and joiners fetch.

Every strategy's ``outer_state_dict`` is a mapping whose values are either a mapping of named
tensors (``params``, ``momentum``, ``velocity`` …) or plain JSON-able data (round numbers,
SPES's expert owners). ``flatten_outer_state`` turns it into named tensors: ``<group>/<name>``
for the tensors and one ``meta/json`` byte tensor for the rest, which also lists every tensor
name — the *manifest*. Every member publishes, for its last completed round, the
``weights_hash`` of that flat form (``outer_state_hash``); ``unflatten_outer_state`` rebuilds
the mapping from a flat state a peer sent, whose manifest ``read_manifest`` validates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lattica.errors import RemoteProtocolError
from lattica.train.engine.checkpoint import StateDict, weights_hash

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
