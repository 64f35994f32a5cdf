"""Framing and screening of inbound Kademlia requests (sans-IO), including a fuzz test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID

from lattica.dht.keys import run_key
from lattica.dht.quota import Refusal, StoreLedger, StoreLimits, provider_entry
from lattica.dht.records import build_validator
from lattica.dht.screen import FrameDecoder, encode_varint, quota_refusal, screen_request
from lattica.errors import RemoteProtocolError

VALIDATOR = build_validator(max_value_bytes=256, max_ttl=60)
PEER = ID.from_pubkey(create_new_key_pair().public_key)


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


def _add_provider(key: bytes, provider_id: bytes) -> Message:
    msg = Message()
    msg.type = Message.MessageType.ADD_PROVIDER
    msg.key = key
    provider = msg.providerPeers.add()
    provider.id = provider_id
    provider.addrs.append(b"\x04\x7f\x00\x00\x01\x06\x10\x00")  # /ip4/127.0.0.1/tcp/4096
    return msg


def test_add_provider_for_a_lattica_key_passes():
    msg = _add_provider(run_key("r1"), PEER.to_bytes())
    assert screen_request(msg.SerializeToString(), validator=VALIDATOR).type == msg.type


@pytest.mark.parametrize("key", [b"k" * 34, b"\x12\x20" + b"k" * 31, b"\x13\x20" + b"k" * 32])
def test_add_provider_for_a_key_outside_lattica_s_form_is_rejected(key):
    with pytest.raises(RemoteProtocolError, match="sha2-256"):
        screen_request(_add_provider(key, PEER.to_bytes()).SerializeToString(), validator=VALIDATOR)


def test_store_requests_over_the_sender_s_quota_are_refused_and_others_pass():
    ledger = StoreLedger(
        StoreLimits(max_records=8, max_bytes=1 << 20, max_records_per_sender=1, max_bytes_per_sender=1 << 16),
    )
    sender = str(PEER)
    provide = _add_provider(run_key("r1"), PEER.to_bytes())
    assert quota_refusal(provide, sender=sender, sender_id=PEER.to_bytes(), ledger=ledger) is None
    ledger.admit(provider_entry(run_key("r0"), sender), sender, 100)
    assert quota_refusal(provide, sender=sender, sender_id=PEER.to_bytes(), ledger=ledger) is Refusal.SENDER_QUOTA
    lookup = Message(type=Message.MessageType.GET_PROVIDERS, key=run_key("r1"))
    assert quota_refusal(lookup, sender=sender, sender_id=PEER.to_bytes(), ledger=ledger) is None


def test_add_provider_with_garbage_peer_id_is_rejected():
    msg = Message()
    msg.type = Message.MessageType.ADD_PROVIDER
    msg.key = run_key("r1")
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
