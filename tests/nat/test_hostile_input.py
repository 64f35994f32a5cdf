"""Malformed messages on the NAT protocols are rejected; the node keeps serving."""

import contextlib

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID

from lattica.net.host import build_host
from lattica.net.nat import HolePuncher, ReachabilityService, RelayServer

pytestmark = pytest.mark.timeout(60)

GARBAGE = [b"\xff\xff\xff\xff\x0f" + b"x" * 64, b"\x05hello", b"\x00", b"\x80" * 12]


async def test_garbage_on_nat_protocols_is_rejected_without_crash():
    loopback = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    server = build_host(create_new_key_pair(), listen_addrs=[loopback])
    client = build_host(create_new_key_pair(), listen_addrs=[loopback])
    reach = ReachabilityService(server)
    relay = RelayServer(server, serve=True)
    punch = HolePuncher(server)
    async with server.run([loopback]), client.run([loopback]), trio.open_nursery() as nursery:
        for svc in (relay, punch, reach):
            await nursery.start(svc.run)
        await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
        for proto in (AUTONAT_PROTOCOL_ID, HOP_PROTOCOL_ID, DCUTR_PROTOCOL_ID):
            for junk in GARBAGE:
                with trio.move_on_after(3):
                    stream = await client.new_stream(server.get_id(), [proto])
                    await stream.write(junk)
                    # a reset stream is an acceptable answer; libp2p raises many kinds
                    with contextlib.suppress(Exception):
                        await stream.read(1024)
                    await stream.close()
        # still serving: a fresh relay stream negotiates fine
        with trio.fail_after(5):
            stream = await client.new_stream(server.get_id(), [HOP_PROTOCOL_ID])
            await stream.close()
        assert relay.serving
        nursery.cancel_scope.cancel()
