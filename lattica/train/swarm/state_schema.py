"""What a fetched outer state must be before this replica loads it (sans-IO).

Theory of operation
-------------------
A fetched state hashes to the value its holders published, which proves only that they sent what
they claimed — not that it is a state of this run. ``OuterStateSchema.of`` describes this
replica's own ``outer_state_dict`` (same model, same strategy): its tensors by parameter name
with their shapes and dtypes, which groups of tensors it has, and the kind of every plain value
in the manifest. ``check_outer_state`` then holds a fetched flat state (``outer_state.flatten_outer_state``)
to that description, before anything of it is loaded:

- the manifest is a JSON object with exactly our keys besides the tensor list; every value of
  the kind ours has: a count is an ``int`` (not a ``bool``) from 0 to ``max_count`` (the run's
  total inner steps, the largest counter any strategy keeps), a list holds at most
  ``max_items`` such counts, a mapping at most ``max_items`` short strings or counts, a string at
  most ``max_chars`` characters. Deeper nesting, floats where we have counts, ``"not-a-round"``
  where we have a round: refused;
- the tensor list names each tensor once, as ``<group>/<parameter>`` of a group we have and a
  parameter of the model; ``params`` (where we have it) holds every parameter;
- every tensor has its parameter's shape and dtype, and every floating-point value is finite.

A state that fails is a ``RemoteProtocolError``: nothing of it was loaded. What passes is
structurally ours; whether its counters agree with the round it was claimed for is checked once
loaded (``Trainer.adopt_outer_state``'s ``check``), since only the strategy knows which counter
is its round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from lattica.errors import RemoteProtocolError
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.outer_state import MANIFEST, read_manifest, unflatten_outer_state

Kind = Literal["count", "counts", "mapping", "text", "flag", "number", "nothing"]
REQUIRED_GROUP = "params"  # every strategy with weights loads all of them from this group


@dataclass(frozen=True, kw_only=True)
class SchemaLimits:
    """Sizes of the plain values of a manifest (its bytes are bounded in ``outer_state.read_manifest``)."""

    max_items: int = 4096  # entries of one list or mapping (SPES: one per expert)
    max_chars: int = 512  # one string, a key of a mapping included

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_chars < 1:
            raise ValueError(f"SchemaLimits needs max_items >= 1 and max_chars >= 1, got {self}")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class OuterStateSchema:
    """This replica's outer state, structurally (module docstring)."""

    tensors: Mapping[str, TensorSpec]  # by parameter name
    groups: frozenset[str]  # tensor groups (a group empty in ours may hold any parameters)
    meta: Mapping[str, Kind]  # plain manifest values by key (an empty group is one: ``{}``)
    max_count: int
    limits: SchemaLimits = SchemaLimits()

    def __post_init__(self) -> None:
        if self.max_count < 0:
            raise ValueError(f"OuterStateSchema max_count must be >= 0, got {self.max_count}")

    @classmethod
    def of(cls, state: Mapping[str, object], *, max_count: int, limits: SchemaLimits | None = None) -> OuterStateSchema:
        """The schema of ``state``, an ``outer_state_dict`` of this replica."""
        tensors: dict[str, TensorSpec] = {}
        groups: set[str] = set()
        meta: dict[str, Kind] = {}
        for key, value in state.items():
            if isinstance(value, Mapping) and value and all(isinstance(t, torch.Tensor) for t in value.values()):
                groups.add(key)
                for name, tensor in value.items():
                    tensors.setdefault(name, TensorSpec(tuple(tensor.shape), tensor.dtype))
            else:
                if isinstance(value, Mapping) and not value:
                    groups.add(key)  # flattened into the manifest as ``{}`` while empty
                meta[key] = _kind_of(key, value)
        return cls(tensors=tensors, groups=frozenset(groups), meta=meta, max_count=max_count,
                   limits=limits or SchemaLimits())


def _kind_of(key: str, value: object) -> Kind:
    if isinstance(value, bool):
        return "flag"
    if isinstance(value, int):
        return "count"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "text"
    if value is None:
        return "nothing"
    if isinstance(value, list | tuple):
        return "counts"
    if isinstance(value, Mapping):
        return "mapping"
    raise TypeError(f"outer state value {key!r} is a {type(value).__name__}: no manifest kind")


def check_outer_state(
    flat: Mapping[str, torch.Tensor], schema: OuterStateSchema, *, peer_id: str | None = None,
) -> StateDict:
    """The ``outer_state_dict`` of ``flat`` when it fits ``schema``; else ``RemoteProtocolError``."""
    manifest = read_manifest(flat, peer_id=peer_id)
    names = manifest.names
    _check_names(names, flat, schema, peer_id)
    _check_meta(manifest.values, names, schema, peer_id)
    for name in names:
        _check_tensor(name, flat[name], schema, peer_id)
    return unflatten_outer_state(flat)


def _refuse(what: str, peer_id: str | None) -> RemoteProtocolError:
    return RemoteProtocolError(f"outer state {what}", peer_id=peer_id)


def _check_meta(
    meta: Mapping[str, object], names: list[str], schema: OuterStateSchema, peer_id: str | None,
) -> None:
    tensor_groups = {name.partition("/")[0] for name in names}
    for key, value in meta.items():
        kind = schema.meta.get(key)
        if key in tensor_groups:
            raise _refuse(f"manifest entry {key[:64]!r} is also a group of tensors", peer_id)
        if kind is None and not (key in schema.groups and value == {}):  # a group of ours, empty in theirs
            raise _refuse(f"has an unknown manifest entry {key[:64]!r}", peer_id)
        if kind is not None and not _fits(value, kind, schema):
            raise _refuse(f"manifest entry {key!r} is not a valid {kind}: {_excerpt(value)}", peer_id)
    for key in sorted(schema.meta.keys() - meta.keys() - schema.groups)[:1]:  # a group may come as tensors
        raise _refuse(f"lacks the manifest entry {key!r}", peer_id)


def _fits(value: object, kind: Kind, schema: OuterStateSchema) -> bool:
    limits = schema.limits
    if kind == "count":
        return _is_count(value, schema.max_count)
    if kind == "counts":
        return isinstance(value, list) and len(value) <= limits.max_items and all(
            _is_count(v, schema.max_count) for v in value
        )
    if kind == "mapping":
        return isinstance(value, dict) and len(value) <= limits.max_items and all(
            _is_text(k, limits.max_chars) and (_is_text(v, limits.max_chars) or _is_count(v, schema.max_count))
            for k, v in value.items()
        )
    if kind == "text":
        return _is_text(value, limits.max_chars)
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value is None


def _is_count(value: object, max_count: int) -> bool:
    return type(value) is int and 0 <= value <= max_count


def _is_text(value: object, max_chars: int) -> bool:
    return isinstance(value, str) and len(value) <= max_chars


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_names(
    names: list[str], flat: Mapping[str, torch.Tensor], schema: OuterStateSchema, peer_id: str | None,
) -> None:
    if len(set(names)) != len(names):
        raise _refuse("names a tensor twice", peer_id)
    if set(flat) != {*names, MANIFEST}:
        raise _refuse("holds other tensors than its manifest lists", peer_id)
    for name in names:
        group, _, parameter = name.partition("/")
        if group not in schema.groups or parameter not in schema.tensors:
            raise _refuse(f"has an unknown tensor {name[:128]!r}", peer_id)
    if REQUIRED_GROUP in schema.groups:
        held = {name.partition("/")[2] for name in names if name.startswith(REQUIRED_GROUP + "/")}
        if held != schema.tensors.keys():
            raise _refuse(f"lacks {len(schema.tensors.keys() - held)} of the model's {REQUIRED_GROUP}", peer_id)


def _check_tensor(name: str, tensor: torch.Tensor, schema: OuterStateSchema, peer_id: str | None) -> None:
    spec = schema.tensors[name.partition("/")[2]]
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise _refuse(
            f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the model's is {spec.dtype} {spec.shape}",
            peer_id,
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise _refuse(f"tensor {name!r} is not finite", peer_id)


__all__ = ["OuterStateSchema", "SchemaLimits", "TensorSpec", "check_outer_state"]
