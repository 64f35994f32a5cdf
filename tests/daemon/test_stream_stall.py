"""A stream survives its reader stalling for 30 s (py-libp2p's yamux gives up after 5 s).

Both the stall and yamux's timeout are measured on trio's clock; the test runs it 5x faster
than the wall clock, so the 30 s stall costs 6 s of real time and still outlasts yamux's 5 s
six times over.
"""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from trio.testing import MockClock

from lattica.net.host import build_host
from lattica.net.streams import DrainingReader
from lattica.net.wire import decode_body, encode_message

PROTO = TProtocol("/lattica/test-stall/1")
STALL_S = 30.0


@pytest.fixture
def fast_clock() -> MockClock:
    """trio's clock at 5x the wall clock (pytest-trio runs the test on it)."""
    return MockClock(rate=5.0)


async def test_stream_survives_a_30_second_reader_stall(fast_clock: MockClock):
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    sender, receiver = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    payload = {"blob": bytes(range(256)) * 16384}  # 4 MiB: far beyond yamux's 256 KiB window
    frame = encode_message(payload)
    received: list[object] = []

    async def slow_handler(stream):
        reader = DrainingReader(stream, max_buffer=8 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.pump)
            await trio.sleep(STALL_S)  # the application is busy and does not read
            length = int.from_bytes(await reader.read_exactly(4), "big")
            received.append(decode_body(await reader.read_exactly(length)))
            nursery.cancel_scope.cancel()
        await stream.close()

    async with sender.run(listen), receiver.run(listen):
        receiver.set_stream_handler(PROTO, slow_handler)
        await sender.connect(info_from_p2p_addr(receiver.get_addrs()[0]))
        stream = await sender.new_stream(receiver.get_id(), [PROTO])
        with trio.fail_after(STALL_S + 30):
            await stream.write(frame)  # raises StreamReset/MuxedStreamError if the window stalls
            while not received:
                await trio.sleep(0.2)
    assert received == [payload]
