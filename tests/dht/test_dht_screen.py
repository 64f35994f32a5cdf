"""Framing and screening of inbound Kademlia requests (sans-IO), including a fuzz test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.kad_dht.pb.kademlia_pb2 import Message

from lattica.dht.records import build_validator
from lattica.dht.screen import FrameDecoder, encode_varint, screen_request
from lattica.errors import RemoteProtocolError

VALIDATOR = build_validator(max_value_bytes=256, max_ttl=60)


def _msg(kind, key=b"k" * 34, **fields) -> bytes:
    msg = Message()
    msg.type = kind
    msg.key = key
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg.SerializeToString()


def test_frames_split_across_feeds_and_back_to_back():
    a, b = b"first", b"second frame"
    wire = encode_varint(len(a)) + a + encode_varint(len(b)) + b
    dec = FrameDecoder(max_frame=100)
    for byte in wire[:3]:
        dec.feed(bytes([byte]))
        assert dec.next_frame() is None
    dec.feed(wire[3:])
    assert dec.next_frame() == a
    assert dec.next_frame() == b
    assert dec.next_frame() is None
    assert dec.pending == 0


def test_oversize_prefix_is_refused_before_the_body_arrives():
    dec = FrameDecoder(max_frame=1000, peer_id="p")
    dec.feed(encode_varint(1001))
    with pytest.raises(RemoteProtocolError) as err:
        dec.next_frame()
    assert err.value.peer_id == "p"


def test_runaway_varint_is_refused():
    dec = FrameDecoder(max_frame=1000)
    dec.feed(b"\x80" * 10)
    with pytest.raises(RemoteProtocolError):
        dec.next_frame()


@pytest.mark.parametrize(
    "kind", [Message.MessageType.FIND_NODE, Message.MessageType.GET_PROVIDERS]
)
def test_well_formed_requests_pass(kind):
    assert screen_request(_msg(kind), validator=VALIDATOR).type == kind


@pytest.mark.parametrize(
    "frame",
    [
        b"\xff\xff\xff",
        _msg(Message.MessageType.FIND_NODE, key=b""),
        _msg(Message.MessageType.GET_VALUE, key=b"k" * 129),
        _msg(Message.MessageType.ADD_PROVIDER, key=b"k" * 81),
        _msg(Message.MessageType.ADD_PROVIDER),  # no providers
        _msg(Message.MessageType.PUT_VALUE),  # no record
        _msg(99),
    ],
)
def test_malformed_requests_are_rejected(frame):
    with pytest.raises(RemoteProtocolError):
        screen_request(frame, validator=VALIDATOR, peer_id="p")


def test_add_provider_with_garbage_peer_id_is_rejected():
    msg = Message()
    msg.type = Message.MessageType.ADD_PROVIDER
    msg.key = b"k" * 34
    msg.providerPeers.add().id = b"\x00\x01not-a-multihash"
    with pytest.raises(RemoteProtocolError):
        screen_request(msg.SerializeToString(), validator=VALIDATOR)


@given(st.binary(max_size=400))
def test_fuzz_only_remote_protocol_errors(data):
    dec = FrameDecoder(max_frame=256)
    dec.feed(data)
    try:
        while (frame := dec.next_frame()) is not None:
            screen_request(frame, validator=VALIDATOR)
    except RemoteProtocolError:
        pass
