"""The sans-IO frame decoder: chunking independence, limits, and fuzzing."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.net.tensors import frames
from lattica.numerics import codecs


def _message(values=(1.0, 2.0, 3.0), tag="t", part=2) -> bytes:
    spec, payload = codecs.encode(torch.tensor(values), "fp32", "w")
    return frames.encode_put(tag, part, [spec]) + bytes(payload)


def _drain(decoder: frames.FrameDecoder, out: list) -> None:
    while (event := decoder.next_event()) is not None:
        if isinstance(event, frames.Incoming) and event.payload_size > 1 << 20:
            decoder.discard()
        elif isinstance(event, frames.Incoming):
            decoder.accept(bytearray(event.payload_size))
        out.append(event)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, 10_000])
def test_any_chunking_yields_the_same_messages(step):
    data = _message() + _message((4.0,), part=3) + frames.encode_fetch("f", ["a", "b"])
    decoder, events = frames.FrameDecoder(), []
    for i in range(0, len(data), step):
        decoder.feed(data[i : i + step])
        _drain(decoder, events)
    done = [e for e in events if isinstance(e, frames.Complete)]
    assert [e.incoming.part for e in done] == [2, 3, 0]
    spec = done[0].incoming.specs[0]
    assert codecs.decode(spec, done[0].payload).tolist() == [1.0, 2.0, 3.0]
    assert done[2].incoming.names == ("a", "b")
    assert decoder.idle


def test_discard_skips_the_payload_without_storing_it():
    decoder = frames.FrameDecoder()
    decoder.feed(_message() + _message((9.0,), part=5))
    first = decoder.next_event()
    assert isinstance(first, frames.Incoming)
    decoder.discard()
    assert decoder.next_event() == frames.Complete(first, None)
    second = decoder.next_event()
    assert second.part == 5


def test_a_decision_is_required_before_the_payload():
    decoder = frames.FrameDecoder()
    decoder.feed(_message())
    decoder.next_event()
    assert decoder.next_event() is None
    with pytest.raises(LocalProtocolError):
        decoder.accept(bytearray(1))


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", 1 << 30) + b"x",  # lying header length
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        frames._frame({"k": "nope", "tag": "t"}),
        frames._frame({"k": "put", "tag": "t", "part": 0, "t": [["w", "float128", [1], "raw"]]}),
        frames._frame({"k": "put", "tag": "t", "part": 0, "t": [["w", "float32", [1], "lz4"]]}),
        frames._frame({"k": "put", "tag": "t", "part": -1, "t": []}),
        frames._frame({"k": "put", "tag": 5, "part": 0, "t": []}),
        frames._frame([1, 2, 3]),
        _message() + b"\x00\x00\x00\x05garbage-after-a-valid-message",
    ],
)
def test_malformed_input_is_a_remote_protocol_error(data):
    decoder = frames.FrameDecoder(peer_id="QmBad", max_header=1 << 16)
    decoder.feed(data)
    with pytest.raises(RemoteProtocolError) as info:
        _drain(decoder, [])
    assert info.value.peer_id == "QmBad"


@given(st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_fuzzed_bytes_never_crash_the_decoder(data):
    decoder = frames.FrameDecoder(max_header=4096)
    decoder.feed(data)
    with contextlib.suppress(RemoteProtocolError):
        _drain(decoder, [])


_header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@given(
    st.fixed_dictionaries(
        {"k": st.sampled_from(["put", "fetch", "x"]), "tag": st.text(max_size=5)},
        optional={"part": _header_values, "t": _header_values, "names": _header_values},
    ),
    st.binary(max_size=64),
)
@settings(max_examples=300, deadline=None)
def test_fuzzed_headers_are_valid_or_remote_errors(header, tail):
    body = msgpack.packb(header, use_bin_type=True)
    decoder = frames.FrameDecoder(max_header=4096)
    decoder.feed(struct.pack(">I", len(body)) + body + tail)
    with contextlib.suppress(RemoteProtocolError):
        _drain(decoder, [])
