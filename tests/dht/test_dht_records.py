"""Record envelopes and namespaced validation (sans-IO)."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lattica.dht.records import (
    ExpiringRecord,
    ExpiringRecordValidator,
    InvalidRecord,
    build_validator,
    encode_record,
    split_lattica_key,
)

NOW = 1_000_000.0


def _validator(**kw) -> ExpiringRecordValidator:
    return ExpiringRecordValidator(max_value_bytes=100, max_ttl=60.0, clock=lambda: NOW, **kw)


def _raw(value=b"v", seq=0, exp=NOW + 30) -> bytes:
    return encode_record(ExpiringRecord(value=value, seq=seq, expires_at=exp))


def test_valid_record_decodes():
    rec = _validator().decode("/lattica/run/r1", _raw(b"hello", seq=3))
    assert (rec.value, rec.seq) == (b"hello", 3)


@pytest.mark.parametrize(
    ("key", "raw"),
    [
        ("/lattica/run/r1", _raw(exp=NOW - 1)),  # expired
        ("/lattica/run/r1", _raw(exp=NOW + 3600)),  # pins itself too far ahead
        ("/lattica/run/r1", _raw(value=b"x" * 101)),  # value over the cap
        ("/lattica/run/r1", b"\x00" * 1000),  # envelope over the cap
        ("/lattica/run/r1", msgpack.packb({"seq": 1, "exp": NOW + 5})),  # missing v
        ("/lattica/run/r1", msgpack.packb({"seq": -1, "exp": NOW + 5, "v": b""})),
        ("/lattica/run/r1", msgpack.packb({"seq": True, "exp": NOW + 5, "v": b""})),
        ("/lattica/run/r1", msgpack.packb([1, 2, 3])),
        ("/lattica/run/r1", b"\xc1"),  # never valid msgpack
        ("/lattica/unknown-kind/r1", _raw()),
        ("/lattica/run/", _raw()),
        ("/lattica/" + "a" * 200, _raw()),
    ],
)
def test_bad_records_are_rejected(key, raw):
    with pytest.raises(InvalidRecord):
        _validator().validate(key, raw)


def test_select_prefers_higher_seq_then_later_expiry_and_skips_invalid():
    v = _validator()
    values = [_raw(seq=1), _raw(seq=2, exp=NOW + 10), _raw(seq=2, exp=NOW + 20), b"junk"]
    assert v.select("/lattica/run/r", values) == 2
    assert v.select("/lattica/run/r", [b"junk", _raw(seq=0)]) == 1


def test_namespaced_validator_refuses_unknown_namespaces():
    v = build_validator(max_value_bytes=100, max_ttl=60)
    for key in ("/pk/abc", "/ipns/abc", "plain", "/evil/x"):
        with pytest.raises(InvalidRecord):
            v.validate(key, b"x")


def test_split_key():
    assert split_lattica_key("/lattica/ckpt/a/b") == ("ckpt", "a/b")


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_other_errors(raw):
    with contextlib.suppress(InvalidRecord):
        _validator().validate("/lattica/run/r", raw)
