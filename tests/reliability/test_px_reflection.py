"""A member's peer-exchange replies cannot turn the swarm into a connection flood.

A hostile member — a real libp2p host that syncs the run's replicated state like any member —
answers every peer-exchange request with 64 made-up peer ids, each at 8 ports of a third host:
a plain TCP listener that counts the connections it is offered. Two real ``lattica join``
daemons dial none of them (no verified membership entry in the replicated state); a node
without the replicated state (a bare ``Node``) dials within the peer-exchange budget only.
"""

from __future__ import annotations

from pathlib import Path

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.config import NodeConfig
from lattica.crdt.state import ReplicatedState
from lattica.net.host import LatticaHost, build_host
from lattica.net.peer_exchange import PX_PROTOCOL, px_reply
from lattica.net.px_dials import PxDialLimits
from lattica.net.wire import read_message, write_message
from lattica.node.node import Node
from lattica_lab.daemons import DaemonProcess

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
FAKE_PEERS = 64
PORTS = 8
WATCH_S = 10.0  # the code before these limits: ~1,300 attempts in this time


class CountingListener:
    """``PORTS`` TCP ports on loopback that accept, count and close every connection."""

    def __init__(self) -> None:
        self.accepted = 0
        self.ports: list[int] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = []
        for _ in range(PORTS):
            listeners += await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.ports = [listener.socket.getsockname()[1] for listener in listeners]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(trio.serve_listeners, self._count, [listener])
            task_status.started()

    async def _count(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        await stream.aclose()


def _fake_entries(ports: list[int]) -> list[tuple[str, list[str]]]:
    entries = []
    for _ in range(FAKE_PEERS):
        fake = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
        entries.append((fake, [f"/ip4/127.0.0.1/tcp/{port}/p2p/{fake}" for port in ports]))
    return entries


def _lying_host(entries: list[tuple[str, list[str]]]) -> tuple[LatticaHost, KeyPair]:
    """A libp2p host that lies in every px reply (and, given the replicated state, is a member)."""
    keys = create_new_key_pair()
    host = build_host(keys)

    async def lie(stream: INetStream) -> None:
        try:
            await read_message(stream, max_size=1024)
            await write_message(stream, px_reply(entries))
        finally:
            await stream.close()

    host.set_stream_handler(PX_PROTOCOL, lie)
    return host, keys


async def _attempts_while(listener: CountingListener, seconds: float) -> int:
    before = listener.accepted
    await trio.sleep(seconds)
    return listener.accepted - before


async def test_made_up_peers_in_px_replies_are_not_dialed_by_the_swarm(tmp_path: Path) -> None:
    daemons: list[DaemonProcess] = []
    listener = CountingListener()
    try:
        a = DaemonProcess(tmp_path / "a").start()
        daemons.append(a)
        await trio.to_thread.run_sync(lambda: a.wait_ready(60))
        a_addr = await trio.to_thread.run_sync(lambda: a.addr)
        b = DaemonProcess(tmp_path / "b", peers=(a_addr,)).start()
        daemons.append(b)
        await trio.to_thread.run_sync(lambda: b.wait_ready(60))
        async with trio.open_nursery() as nursery:
            await nursery.start(listener.run)
            host, keys = _lying_host(_fake_entries(listener.ports))
            async with host.run([LOOPBACK]):
                member = ReplicatedState(host, keys, data_dir=tmp_path / "mallory", run_id="default")
                await nursery.start(member.run)
                await member.update_member(role="observer", addrs=[str(host.get_addrs()[0])])
                await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(a_addr)))
                with trio.fail_after(30):  # a member of both: its record and vouches reached them
                    while host.get_id().to_base58() not in await trio.to_thread.run_sync(
                        lambda: b.call("state")["live"]
                    ):
                        await trio.sleep(0.5)
                attempts = await _attempts_while(listener, WATCH_S)
                asked = len(host.get_connected_peers())
                nursery.cancel_scope.cancel()
        assert asked == 2  # both daemons talk to it (and so ask it for peers every two seconds)
        assert attempts == 0
        for daemon in daemons:
            peers = await trio.to_thread.run_sync(lambda d=daemon: d.call("peers"))
            assert len(peers) <= 3  # the other daemon and the hostile member (and nobody made up)
    finally:
        for daemon in daemons:
            daemon.kill()


async def test_without_the_replicated_state_px_dials_stay_within_the_budget(tmp_path: Path) -> None:
    listener = CountingListener()
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        host, _ = _lying_host(_fake_entries(listener.ports))
        async with host.run([LOOPBACK]):
            config = NodeConfig(
                data_dir=tmp_path / "bare", listen=("/ip4/127.0.0.1/tcp/0",), metrics_addr=None, dht=False,
                peers=(str(host.get_addrs()[0]),),
            )
            node = Node(config, create_new_key_pair())
            await nursery.start(node.run)
            attempts = await _attempts_while(listener, WATCH_S)
            node.request_shutdown()
            nursery.cancel_scope.cancel()
    limits = PxDialLimits()
    assert 0 < attempts <= limits.per_source  # one source, within one window
