"""Run discovery and content routing between real hosts on 127.0.0.1."""

from __future__ import annotations

import trio
from dht_cluster import connect, running_host, running_hosts

from lattica.dht import DHTConfig, RunDiscovery

# Quick rounds while a node knows fewer than min_run_peers members, then quiet: the shared
# test machine has two cores, so background DHT traffic is kept low.
FAST = DHTConfig(
    provider_ttl=60.0,
    reprovide_interval=30.0,
    lookup_interval=4.0,
    query_timeout=5.0,
    record_ttl=60.0,
    republish_interval=30.0,
    min_run_peers=8,
)
# Short-lived provider records, for the member-leaves test.
EXPIRING = DHTConfig(
    provider_ttl=4.0,
    reprovide_interval=1.5,
    lookup_interval=1.0,
    query_timeout=5.0,
    record_ttl=60.0,
    republish_interval=30.0,
    min_run_peers=1,
)


async def _start_chain(nursery, hosts, *, run_id="run-a", config=FAST):
    """Each node knows only the previous one; all start at once, as a fleet would."""
    async with trio.open_nursery() as dialing:
        for i in range(1, len(hosts)):
            dialing.start_soon(connect, hosts[i], hosts[i - 1])
    nodes = [RunDiscovery(host, run_id=run_id, config=config) for host in hosts]
    async with trio.open_nursery() as starting:
        for node in nodes:
            starting.start_soon(nursery.start, node.run)
    return nodes


def _member_ids(node) -> set:
    return {info.peer_id for info in node.known_run_members()}


async def test_chain_of_eight_discovers_the_run_and_every_content_holder():
    async with running_hosts(8) as hosts, trio.open_nursery() as nursery:
        nodes = await _start_chain(nursery, hosts)
        everyone = {h.get_id() for h in hosts}
        with trio.fail_after(30):
            while any(_member_ids(n) != everyone - {h.get_id()} for n, h in zip(nodes, hosts, strict=True)):
                await trio.sleep(0.2)
        first = set(hosts[0].get_connected_peers())
        assert everyone - {hosts[0].get_id()} <= first  # the first node now reaches the last
        assert all(n.routing_table_size() >= 4 for n in nodes)

        shard = bytes.fromhex("ab" * 32)
        holders = {1, 4, 6}
        for i in holders:
            assert await nodes[i].provide_content(shard)
            assert await nodes[i].provide_content(shard)  # announcing twice must not duplicate
        for seeker in (0, 7, 4):
            found = await nodes[seeker].find_content_providers(shard)
            ids = [info.peer_id for info in found]
            assert len(ids) == len(set(ids))
            assert set(ids) == {hosts[i].get_id() for i in holders}
            assert all(info.addrs for info in found)
        assert await nodes[2].find_content_providers(b"\x01" * 32) == []
        nursery.cancel_scope.cancel()


async def test_other_runs_are_not_mixed_in():
    async with running_hosts(4) as hosts, trio.open_nursery() as nursery:
        a = await _start_chain(nursery, hosts[:2], run_id="run-a")
        await connect(hosts[2], hosts[1])
        await connect(hosts[3], hosts[2])
        b = [RunDiscovery(h, run_id="run-b", config=FAST) for h in hosts[2:]]
        for node in b:
            await nursery.start(node.run)
        with trio.fail_after(10):
            while not (_member_ids(b[0]) and _member_ids(a[0])):
                await a[0].refresh_members()
                await b[0].refresh_members()
        assert _member_ids(a[0]) == {hosts[1].get_id()}
        assert _member_ids(b[0]) == {hosts[3].get_id()}
        nursery.cancel_scope.cancel()


async def test_member_that_leaves_disappears_after_expiry():
    async with running_hosts(4) as hosts, trio.open_nursery() as nursery:
        nodes = await _start_chain(nursery, hosts, config=EXPIRING)
        async with running_host() as leaver, trio.open_nursery() as leaver_nursery:
            await connect(leaver, hosts[-1])
            await leaver_nursery.start(RunDiscovery(leaver, run_id="run-a", config=EXPIRING).run)
            with trio.fail_after(30):  # bounds for a loaded 2-core machine
                while leaver.get_id() not in _member_ids(nodes[0]):
                    await trio.sleep(0.2)
            leaver_nursery.cancel_scope.cancel()
        left_at = trio.current_time()
        with trio.fail_after(EXPIRING.provider_ttl + 20):
            while any(leaver.get_id() in _member_ids(n) for n in nodes):
                await trio.sleep(0.2)
        # It lapsed because its records expired, not earlier: live members stayed.
        ttl, period = EXPIRING.provider_ttl, EXPIRING.reprovide_interval
        assert trio.current_time() - left_at >= ttl - period - EXPIRING.lookup_interval
        assert all(len(_member_ids(n)) == 3 for n in nodes)
        nursery.cancel_scope.cancel()


async def test_client_mode_node_still_discovers_and_is_found():
    async with running_hosts(4) as hosts, trio.open_nursery() as nursery:
        nodes = await _start_chain(nursery, hosts[:3])
        await connect(hosts[3], hosts[2])
        behind_nat = RunDiscovery(hosts[3], run_id="run-a", config=FAST)
        await behind_nat.set_reachability(False)
        await nursery.start(behind_nat.run)
        assert not behind_nat.dht.is_server
        with trio.fail_after(10):
            while len(_member_ids(behind_nat)) < 3 or hosts[3].get_id() not in _member_ids(nodes[0]):
                await trio.sleep(0.2)
        assert behind_nat.status()["dht_mode"] == "client"
        await behind_nat.set_reachability(True)
        assert behind_nat.dht.is_server
        assert behind_nat.status()["run_members"] == 3
        nursery.cancel_scope.cancel()
