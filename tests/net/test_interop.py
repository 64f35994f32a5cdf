"""A Lattica node among standard libp2p peers (py-libp2p's own services, no Lattica protocol).

Real hosts on loopback: a standard DHT server as the only bootstrap peer learns that the node
serves Kademlia and keeps it in its routing table; a node whose only address is a relay
address on a standard relay is joined with ``--peer <relay addr>/p2p-circuit/p2p/<id>``.
"""

from __future__ import annotations

from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.peer.peerinfo import PeerInfo
from standard_node import standard_node

from lattica.config import NodeConfig
from lattica.daemon import build_node
from lattica.net.host import build_host
from lattica.net.nat import RelayReservations, RelayServer
from lattica.node import Node

pytestmark = pytest.mark.timeout(90)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _config(data_dir: Path, peers: tuple[str, ...], **overrides) -> NodeConfig:
    fields = dict(data_dir=data_dir, listen=(LOOPBACK,), peers=peers, run_id="interop",
                  metrics_addr=None, bootstrap_timeout_s=20)
    fields.update(overrides)
    return NodeConfig(**fields)


async def _wait(predicate, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.1)


async def test_a_standard_dht_server_adds_the_node_to_its_routing_table(tmp_path) -> None:
    async with standard_node() as server, trio.open_nursery() as nursery:
        node: Node = build_node(_config(tmp_path / "n", (server.addr,)), create_new_key_pair())
        await nursery.start(node.run)
        me = node.peer_id.to_base58()
        # what identify told the server (a go-libp2p server adds a peer on exactly this)
        await _wait(lambda: str(KAD_PROTOCOL) in server.describe(me)["protocols"], 15)
        await _wait(lambda: server.describe(me)["in_routing_table"], 15)
        # and it stays there: the server's own identify-checked add accepts the node
        assert await server.kad.routing_table.add_peer(node.peer_id)
        node.request_shutdown()


async def test_a_node_behind_a_relay_is_joined_by_its_circuit_address(tmp_path) -> None:
    async with standard_node() as relay, trio.open_nursery() as nursery:
        # the target: reachable only through its reservation on the standard relay (nobody
        # is told a direct address of it)
        target = build_host(create_new_key_pair(), listen_addrs=[multiaddr.Multiaddr(LOOPBACK)])
        async with target.run([multiaddr.Multiaddr(LOOPBACK)]):
            await nursery.start(RelayServer(target, serve=False).run)  # answers STOP
            reservations = RelayReservations(
                target, relays=[PeerInfo(relay.host.get_id(), relay.host.get_addrs())], want=1)
            await nursery.start(reservations.run)
            await _wait(reservations.relay_addrs, 10)
            circuit = str(reservations.relay_addrs()[0])
            assert circuit.endswith(f"/p2p-circuit/p2p/{target.get_id()}")
            node: Node = build_node(
                _config(tmp_path / "n", (circuit,), dht=False, peer_exchange=False),
                create_new_key_pair())
            with trio.fail_after(30):
                await nursery.start(node.run)  # start-up fails unless the bootstrap peer answered
            assert target.get_id() in node.running_host.get_connected_peers()
            record = node.peer_book.get(target.get_id().to_base58())
            assert record is not None
            assert record.bootstrap
            node.request_shutdown()
            nursery.cancel_scope.cancel()
