"""Real libp2p hosts on 127.0.0.1 for DHT tests and the benchmark, all in one trio loop."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from lattica.net.host import build_host

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


@asynccontextmanager
async def running_host():
    host = build_host(create_new_key_pair(), listen_addrs=[LOOPBACK])
    async with host.run([LOOPBACK]):
        yield host


@asynccontextmanager
async def running_hosts(n: int):
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(running_host()) for _ in range(n)]
        yield hosts


def info_of(host) -> PeerInfo:
    return PeerInfo(host.get_id(), host.get_addrs())


async def connect(a, b) -> None:
    with trio.fail_after(10):
        await a.connect(info_of(b))
