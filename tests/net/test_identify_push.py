"""Identify push on the wire: what a peer receives when our announcement changes.

Two real hosts over loopback; the receiving one replaces its push handler with one that keeps
the raw bytes, so the frame is checked as it travelled, the way go-libp2p would parse it.
"""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils.varint import decode_uvarint_from_stream

from lattica.net.host import AnnouncementWatcher, build_host
from lattica.net.identify_push import IDENTIFY_PUSH

pytestmark = pytest.mark.timeout(60)

OBSERVED_ADDR_FIELD = 4  # Identify.observedAddr in identify.proto


def _field_numbers(body: bytes) -> list[int]:
    """The field numbers of a protobuf message, read from the wire (only the types identify
    uses: varints and length-delimited fields)."""
    numbers, at = [], 0
    while at < len(body):
        key, at = _varint(body, at)
        number, wire_type = key >> 3, key & 7
        numbers.append(number)
        if wire_type == 0:
            _, at = _varint(body, at)
        elif wire_type == 2:
            length, at = _varint(body, at)
            at += length
        else:
            raise AssertionError(f"unexpected wire type {wire_type}")
    return numbers


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


async def _received_push(trigger_change: bool) -> bytes:
    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    sender = build_host(create_new_key_pair(), listen_addrs=[listen])
    receiver = build_host(create_new_key_pair(), listen_addrs=[listen])
    frames: list[bytes] = []
    arrived = trio.Event()

    async def keep_push(stream: INetStream) -> None:
        length = await decode_uvarint_from_stream(stream)
        body = b""
        while len(body) < length:
            body += await stream.read(length - len(body))
        frames.append(body)
        arrived.set()
        await stream.close()

    async with sender.run([listen]), receiver.run([listen]), trio.open_nursery() as nursery:
        receiver.set_stream_handler(IDENTIFY_PUSH, keep_push)
        watcher = AnnouncementWatcher(sender, interval=0.05)
        await nursery.start(watcher.run)
        await sender.connect(PeerInfo(receiver.get_id(), receiver.get_addrs()))
        with trio.fail_after(10):
            while not receiver.get_peerstore().get_protocols(sender.get_id()):
                await trio.sleep(0.05)  # identify on connect
        if trigger_change:  # a new relay address: the watcher pushes it
            relay = f"/ip4/198.18.0.1/tcp/4001/p2p/{receiver.get_id()}/p2p-circuit"
            sender.set_circuit_addrs([relay])
        else:
            await watcher.push()
        with trio.fail_after(10):
            await arrived.wait()
        nursery.cancel_scope.cancel()
    return frames[0]


@pytest.mark.parametrize("trigger_change", [False, True], ids=["push", "pushed-on-new-address"])
async def test_an_identify_push_carries_no_observed_address_field(trigger_change: bool) -> None:
    body = await _received_push(trigger_change)
    assert OBSERVED_ADDR_FIELD not in _field_numbers(body)
    message = Identify()
    message.ParseFromString(body)
    assert not message.HasField("observed_addr")
    # the rest of the announcement is all there
    assert message.HasField("public_key")
    assert message.listen_addrs
    assert message.protocols
    if trigger_change:
        assert any("p2p-circuit" in str(multiaddr.Multiaddr(a)) for a in message.listen_addrs)
