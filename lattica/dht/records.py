"""DHT value records: namespaced validators, size caps and expiry (sans-IO).

Theory of operation
-------------------
Every value Lattica stores in the DHT lives under ``/lattica/<kind>/<name>`` and is wrapped in
a small msgpack envelope ``{"seq": int, "exp": float, "v": bytes}``:

- ``exp`` is an absolute UNIX time; a record past it is invalid everywhere (a holder stops
  serving it, a reader ignores it). The owner republishes before it lapses.
- ``seq`` orders versions: ``select`` prefers the highest ``seq``, then the later ``exp``.
- The whole envelope is capped at ``max_value_bytes`` plus a fixed overhead, checked before
  decoding, and the ``exp`` may lie at most ``max_ttl`` (+ clock skew) in the future, so a
  peer cannot pin a record forever.

The DHT is run with strict namespaces: a key outside a registered namespace, or a kind the
validator does not know, is rejected. Validators raise ``InvalidRecord``; the caller that knows
the sending peer turns it into a ``RemoteProtocolError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgpack
from libp2p.records.validator import NamespacedValidator, Validator

NAMESPACE = "lattica"
DEFAULT_KINDS = frozenset({"run", "ckpt", "peer"})
ENVELOPE_OVERHEAD = 64
CLOCK_SKEW = 60.0
MAX_KEY_BYTES = 128


class InvalidRecord(ValueError):
    """A DHT record (key or value) that no Lattica node accepts."""


@dataclass(frozen=True, kw_only=True)
class ExpiringRecord:
    value: bytes
    seq: int
    expires_at: float


def encode_record(record: ExpiringRecord) -> bytes:
    packed: bytes = msgpack.packb(
        {"seq": record.seq, "exp": record.expires_at, "v": record.value}, use_bin_type=True
    )
    return packed


def decode_record(raw: bytes, *, max_value_bytes: int) -> ExpiringRecord:
    if len(raw) > max_value_bytes + ENVELOPE_OVERHEAD:
        raise InvalidRecord(f"record of {len(raw)} bytes exceeds the size cap")
    try:
        obj = msgpack.unpackb(raw, raw=False)  # size already capped above
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise InvalidRecord(f"record is not a msgpack envelope: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"seq", "exp", "v"}:
        raise InvalidRecord("record envelope must have exactly seq, exp and v")
    seq, exp, value = obj["seq"], obj["exp"], obj["v"]
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise InvalidRecord("record seq must be a non-negative 63-bit integer")
    if not isinstance(exp, int | float) or isinstance(exp, bool) or exp != exp:
        raise InvalidRecord("record exp must be a number")
    if not isinstance(value, bytes) or len(value) > max_value_bytes:
        raise InvalidRecord(f"record value must be bytes of at most {max_value_bytes}")
    return ExpiringRecord(value=value, seq=seq, expires_at=float(exp))


def split_lattica_key(key: str) -> tuple[str, str]:
    """``/lattica/<kind>/<name>`` -> ``(kind, name)``; raises ``InvalidRecord``."""
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidRecord(f"key longer than {MAX_KEY_BYTES} bytes")
    parts = key.split("/", 3)
    if len(parts) != 4 or parts[0] or parts[1] != NAMESPACE or not parts[2] or not parts[3]:
        raise InvalidRecord(f"key {key[:80]!r} is not /{NAMESPACE}/<kind>/<name>")
    return parts[2], parts[3]


class ExpiringRecordValidator(Validator):
    """Validator for the ``lattica`` namespace: known kinds, size cap, bounded expiry."""

    def __init__(
        self,
        *,
        max_value_bytes: int,
        max_ttl: float,
        kinds: Collection[str] = DEFAULT_KINDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_value_bytes = max_value_bytes
        self._max_ttl = max_ttl
        self._kinds = frozenset(kinds)
        self._clock = clock

    def decode(self, key: str, value: bytes) -> ExpiringRecord:
        kind, _ = split_lattica_key(key)
        if kind not in self._kinds:
            raise InvalidRecord(f"unknown record kind {kind[:40]!r}")
        record = decode_record(value, max_value_bytes=self._max_value_bytes)
        now = self._clock()
        if record.expires_at <= now:
            raise InvalidRecord("record has expired")
        if record.expires_at > now + self._max_ttl + CLOCK_SKEW:
            raise InvalidRecord("record expires too far in the future")
        return record

    def validate(self, key: str, value: bytes) -> None:
        self.decode(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        if not values:
            raise ValueError("select needs at least one value")
        best, best_rank = 0, (-1, float("-inf"))
        for i, raw in enumerate(values):
            try:
                rec = self.decode(key, raw)
            except InvalidRecord:
                continue
            if (rec.seq, rec.expires_at) > best_rank:
                best, best_rank = i, (rec.seq, rec.expires_at)
        return best


class StrictNamespacedValidator(NamespacedValidator):
    """Namespaced validation where unknown namespaces are errors, not pass-throughs."""

    def validate(self, key: str, value: bytes) -> None:
        try:
            super().validate(key, value)
        except InvalidRecord:
            raise
        except Exception as exc:  # noqa: BLE001 - the library's validators raise their own kinds; all mean an invalid record
            raise InvalidRecord(str(exc)[:200]) from None


def build_validator(*, max_value_bytes: int, max_ttl: float) -> StrictNamespacedValidator:
    """The validator every Lattica DHT node runs: only ``/lattica/...`` keys are accepted."""
    return StrictNamespacedValidator(
        {NAMESPACE: ExpiringRecordValidator(max_value_bytes=max_value_bytes, max_ttl=max_ttl)},
        strict_validation=True,
    )
