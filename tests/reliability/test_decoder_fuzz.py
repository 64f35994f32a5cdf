"""Every decoder of peer input, fuzzed: the only outcomes are a value or our error type.

Wire framing (with a stream that lies about lengths), state-sync hello/batches and envelopes,
DHT records, the control API, px replies, and round requests through the real
``RoundCoordinator`` handler. Each example is bounded in time; the framing is checked not to
allocate what a length prefix or a msgpack header merely claims. Tensor frames are fuzzed in
``tests/net/tensors/test_tensors_frames.py``.
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from types import SimpleNamespace

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lattica.control.protocol import BadRequest, decode_request, decode_response
from lattica.coordination.rounds import RoundCoordinator
from lattica.crdt.envelope import envelope_from_wire
from lattica.crdt.sync import parse_batch, parse_hello
from lattica.dht.records import InvalidRecord, decode_record
from lattica.errors import LatticaError, LocalProtocolError, RemoteError, RemoteProtocolError
from lattica.net.peer_exchange import parse_px_reply
from lattica.net.wire import decode_body, read_message

PEER = "12D3KooWJbM6u2R3tE5hD3ZKg1b3wHv7n9t4yZ6JzWq2mF8o1QxA"
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=20,
)
messages = st.one_of(
    values,
    st.fixed_dictionaries(
        {"t": st.sampled_from(["hello", "envs", "end", "x"])},
        optional={"run": st.sampled_from(["r", "other", 3]), "sv": values, "envs": st.lists(values, max_size=3)},
    ),
    st.fixed_dictionaries(
        {"peers": st.lists(st.fixed_dictionaries({"id": values, "addrs": values}), max_size=4)}
    ),
)


class _Stream:
    """Plays back bytes in random-sized reads, then EOF; records what is written."""

    def __init__(self, data: bytes, cut: int = 7) -> None:
        self.data, self.cut, self.written = data, max(cut, 1), b""
        self.muxed_conn = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: PEER))

    async def read(self, n: int = -1) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.data:
            raise EOFError
        chunk, self.data = self.data[: min(n, self.cut)], self.data[min(n, self.cut) :]
        return chunk

    async def write(self, data: bytes) -> None:
        self.written += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


def _framed(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


@given(st.binary(max_size=300), st.integers(1, 64))
@FUZZ
def test_the_framing_survives_arbitrary_bytes(data, cut) -> None:
    async def main() -> None:
        with trio.fail_after(2):
            with contextlib.suppress(RemoteError):
                await read_message(_Stream(data, cut), max_size=1024, peer_id=PEER)

    trio.run(main)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", 0xFFFFFFFF) + b"x" * 64,  # a 4 GiB length prefix
        # array32 of 2^31 entries
        _framed(b"")[:4].replace(b"\x00\x00\x00\x01", struct.pack(">I", 5)) + b"\xdd\x7f\xff\xff\xff",
        struct.pack(">I", 5) + b"\xdf\x7f\xff\xff\xff",  # map32 of 2^31 entries
        struct.pack(">I", 5) + b"\xc6\x7f\xff\xff\xff",  # bin32 of 2 GiB
    ],
)
def test_claimed_sizes_are_not_allocated(data) -> None:
    async def main() -> None:
        with trio.fail_after(2), pytest.raises(RemoteError):
            await read_message(_Stream(data, 64), max_size=1 << 20, peer_id=PEER)

    tracemalloc.start()
    try:
        trio.run(main)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@given(messages)
@FUZZ
def test_state_sync_messages_parse_or_raise_remote_errors(obj) -> None:
    for parse in (lambda o: parse_hello(o, run_id="r", peer_id=PEER), lambda o: parse_batch(o, peer_id=PEER)):
        try:
            parsed = parse(obj)
        except RemoteProtocolError:
            continue
        for raw in parsed or []:
            with contextlib.suppress(RemoteProtocolError):
                envelope_from_wire(raw, max_update_bytes=1024, peer_id=PEER)


@given(st.dictionaries(
    st.sampled_from(["run", "doc", "writer", "seq", "full", "update", "key", "sig", "x"]), values, max_size=9,
))
@FUZZ
def test_envelopes_parse_or_are_rejected(obj) -> None:
    with contextlib.suppress(RemoteProtocolError):
        envelope_from_wire(obj, max_update_bytes=1024, peer_id=PEER)


@given(st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True))))
@FUZZ
def test_dht_records_decode_or_are_invalid(raw) -> None:
    with contextlib.suppress(InvalidRecord):
        decode_record(raw, max_value_bytes=128)


@given(st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True))))
@FUZZ
def test_msgpack_bodies_decode_or_raise_remote_errors(raw) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_body(raw, peer_id=PEER)


@given(st.one_of(st.binary(max_size=200), values.map(lambda v: __import__("json").dumps(v, default=str).encode())))
@FUZZ
def test_control_api_lines_decode_or_are_refused(line) -> None:
    with contextlib.suppress(BadRequest):
        decode_request(line)
    with contextlib.suppress(LocalProtocolError):
        decode_response(line)


@given(messages)
@FUZZ
def test_px_replies_parse_or_raise_remote_errors(obj) -> None:
    try:
        entries = parse_px_reply(obj, peer_id=PEER)
    except RemoteProtocolError:
        return
    assert all(isinstance(pid, str) and isinstance(addrs, list) for pid, addrs in entries)


@given(st.one_of(messages.map(_framed), st.binary(max_size=100)), st.integers(1, 16))
@FUZZ
def test_round_requests_through_the_real_handler_end_quickly(data, cut) -> None:
    async def main() -> None:
        coordinator = RoundCoordinator(
            SimpleNamespace(), peer_id=PEER, run_id="r", candidates=lambda: [PEER], deadline_s=0.05,
        )
        async with trio.open_nursery() as nursery:
            coordinator._nursery = nursery
            stream = _Stream(data, cut)
            with trio.fail_after(2):
                await coordinator._handle(stream)  # never raises: bad input ends the stream
            if stream.written:
                reply = msgpack.unpackb(stream.written[4:])
                assert reply == {"group": [PEER]}
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except LatticaError as exc:  # pragma: no cover - the handler must swallow peer errors
        raise AssertionError(f"handler raised {exc!r}") from exc
