"""How the DHT reaches the peers it queries: within the query timeout, through ``reach``.

Real hosts on 127.0.0.1. A "silent" peer is a TCP listener that accepts and never answers:
its dial hangs in the security handshake, as a dial into a NAT that drops packets hangs.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager

import multiaddr
import pytest
import trio
from dht_cluster import connect, running_hosts
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht import DHTConfig, LatticaDHT, RunDiscovery, run_key
from lattica.dht.discovery import lookup_delay

pytestmark = pytest.mark.timeout(60)

QUICK = DHTConfig(query_timeout=1.0, lookup_interval=8.0)


@contextmanager
def silent_peer():
    """(peer id, address) of a listener that accepts connections and never speaks."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        peer = ID.from_pubkey(create_new_key_pair().public_key)
        yield peer, multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}")
    finally:
        listener.close()


async def test_a_walk_gives_up_on_a_silent_peer_after_the_query_timeout():
    """py-libp2p's own FIND_NODE queries wait 10 s; ours the configured timeout."""
    async with running_hosts(2) as (a, b):
        dht_a, _dht_b = LatticaDHT(a, config=QUICK), LatticaDHT(b, config=QUICK)
        await connect(a, b)
        with silent_peer() as (silent, addr):
            a.get_peerstore().add_addrs(silent, [addr], 60)
            started = trio.current_time()
            with trio.fail_after(8):
                closest = await dht_a.kad.peer_routing.find_closest_peers_network(b"some key")
            assert b.get_id() in closest
            assert trio.current_time() - started < 8


async def test_peers_the_dht_queries_are_dialed_through_reach():
    """b knows c; a learns c from b's answer with an address that leads nowhere, and reaches
    it anyway through ``reach`` (in the daemon: the path dialer with the relay addresses)."""
    async with running_hosts(3) as (a, b, c), trio.open_nursery() as nursery:
        reached: list[ID] = []

        async def reach(info: PeerInfo) -> bool:
            reached.append(info.peer_id)
            real = {b.get_id(): b, c.get_id(): c}.get(info.peer_id)
            if real is None:
                return False
            await a.get_network().dial_addr(real.get_transport_addrs()[0], info.peer_id)
            return True

        await connect(b, c)
        members = [RunDiscovery(h, run_id="r", config=QUICK) for h in (b, c)]
        for member in members:
            await nursery.start(member.run)
        with trio.fail_after(15):
            while not members[0].known_run_members():
                await trio.sleep(0.1)
        dht_a = LatticaDHT(a, config=QUICK, reach=reach)
        await connect(a, b)
        with silent_peer() as (_, nowhere):
            a.get_peerstore().add_addrs(c.get_id(), [nowhere], 60)  # all the peerstore knows of c
            with trio.fail_after(10):
                result = await dht_a.find_providers(run_key("r"))
        assert c.get_id() in reached
        assert c.get_id() in {p.peer_id for p in result.providers}
        assert c.get_id() in a.get_connected_peers()
        nursery.cancel_scope.cancel()


async def test_a_provider_is_handed_over_while_the_walk_still_waits():
    async with running_hosts(3) as (a, b, c), trio.open_nursery() as nursery:
        await connect(b, c)
        members = [RunDiscovery(h, run_id="r", config=QUICK) for h in (b, c)]
        for member in members:
            await nursery.start(member.run)
        with trio.fail_after(15):
            while not members[0].known_run_members():
                await trio.sleep(0.1)
        dht_a = LatticaDHT(a, config=DHTConfig(query_timeout=4.0))
        await connect(a, b)
        found_at: dict[ID, float] = {}
        with silent_peer() as (silent, addr):
            a.get_peerstore().add_addrs(silent, [addr], 60)
            await dht_a.kad.routing_table.add_peer(PeerInfo(silent, [addr]))
            started = trio.current_time()
            await dht_a.find_providers(
                run_key("r"), on_provider=lambda info: found_at.setdefault(info.peer_id, trio.current_time()))
            ended = trio.current_time()
        providers = {b.get_id(), c.get_id()}
        assert providers <= found_at.keys()
        # handed over when b answered, not when the query of the silent peer gave up
        assert all(found_at[p] - started < ended - started - 1.0 for p in providers), (found_at, started, ended)
        nursery.cancel_scope.cancel()


def test_lookups_come_quickly_while_no_member_is_known():
    config = DHTConfig(lookup_interval=60.0, min_run_peers=8)
    assert [lookup_delay(config, 0, n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0]
    assert lookup_delay(config, 3, 0) == 15.0
    assert lookup_delay(config, 8, 0) == 60.0
