"""Narrowing decoded, untrusted values to typed ones.

The decoders at the edges (``msgpack.unpackb`` in ``net/wire.py``, ``json.loads``, pycrdt's
``to_py``) return values of unknown shape. They are typed ``object`` where they come in and
narrowed here before use. Every function returns ``None`` (or skips the element) for a value
of the wrong shape and never raises: whether a bad shape is a protocol error, a skipped
field or a default is the caller's decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

_Built = TypeVar("_Built")


def str_map(value: object) -> dict[str, object] | None:
    """``value`` when it is a dict whose keys are all strings (msgpack maps may have any keys)."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return None
    return cast("dict[str, object]", value)  # every key checked above


def str_list(value: object) -> list[str] | None:
    """``value`` when it is a list of strings only."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return None
    return cast("list[str]", value)  # every item checked above


def exact_int(value: object) -> int | None:
    """An int that is not a bool (``True`` is an ``int`` to Python, not to a wire format)."""
    return value if type(value) is int else None


def finite_float(value: object) -> float | None:
    """A finite int or float (not a bool) as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def bounded_text(value: object, *, max_len: int) -> str | None:
    """A string of at most ``max_len`` characters."""
    return value if isinstance(value, str) and len(value) <= max_len else None


def build(factory: Callable[..., _Built], fields: Mapping[str, object]) -> _Built:
    """``factory(**fields)`` for a validating constructor (a config or record dataclass whose
    ``__post_init__`` checks its fields) given decoded keyword arguments: a wrong key or value
    raises ``TypeError`` or ``ValueError`` there, not here."""
    return factory(**fields)
