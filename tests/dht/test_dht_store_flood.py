"""Record floods against a real DHT node: refused beyond the store limits, own and members'
records kept, the flooders not banned for it (over quota is not bad input)."""

from __future__ import annotations

import trio
from dht_cluster import connect, info_of, running_hosts

from lattica.dht import DHTConfig, LatticaDHT, run_key
from lattica.dht.keys import content_key
from lattica.dht.quota import StoreLimits
from lattica_lab.dht_flood import add_provider_frame, put_value_frame, store_request

FLOOD_VALUE = b"x" * 16_000  # just under the default max_value_bytes, as in a real flood


async def _acknowledged(sender, receiver, frame: bytes) -> bool:
    return await store_request(sender, info_of(receiver), frame)


async def _wait_for_provider(dht: LatticaDHT, key: bytes, peer) -> None:
    with trio.fail_after(10):
        while peer not in {p.peer_id for p in dht.providers.get_providers(key)}:
            await trio.sleep(0.05)


def _attacker_records(dht: LatticaDHT, attackers) -> tuple[int, int]:
    held = [dht.ledger.holdings(str(a.get_id())) for a in attackers]
    return sum(r for r, _ in held), sum(b for _, b in held)


async def test_a_value_flood_from_one_outsider_stops_at_its_quota():
    limits = StoreLimits()
    async with running_hosts(3) as (victim, member, attacker):
        victim_dht = LatticaDHT(victim, config=DHTConfig())
        member_dht = LatticaDHT(member, config=DHTConfig())
        with trio.fail_after(60):
            await victim_dht.put_record("/lattica/ckpt/own", b"the node's own record")
            await connect(member, victim)
            await member_dht.bootstrap()
            await member_dht.provide(run_key("honest-run"))
            await _wait_for_provider(victim_dht, run_key("honest-run"), member.get_id())
            await connect(attacker, victim)
            results = [
                await _acknowledged(attacker, victim, put_value_frame(f"/lattica/run/flood-{i}", FLOOD_VALUE))
                for i in range(120)
            ]
        records, stored = _attacker_records(victim_dht, [attacker])
        assert 0 < sum(results) == records  # the first ones in, the rest refused
        assert stored <= limits.max_bytes_per_sender
        assert len(victim_dht.values.store) == records + 1  # the flood's share and our own record
        assert victim_dht.store_stats().refused["sender-quota"] == 120 - records
        assert victim_dht.values.get(b"/lattica/ckpt/own") is not None
        assert member.get_id() in {p.peer_id for p in victim_dht.providers.get_providers(run_key("honest-run"))}
        assert victim_dht.rejected_inputs == 0  # over quota is not bad input: nobody is banned
        assert attacker.get_id() in victim.get_connected_peers()


async def test_a_flood_spread_over_many_identities_stays_within_the_total_and_evicts_only_itself():
    limits = StoreLimits(max_records=24, max_bytes=96 << 10, max_records_per_sender=8, max_bytes_per_sender=32 << 10)
    config = DHTConfig(max_value_bytes=1024, max_message_bytes=8 * 1024, store=limits)
    async with running_hosts(8) as (victim, member, *attackers):
        victim_dht = LatticaDHT(victim, config=config)
        member_dht = LatticaDHT(member, config=config)
        with trio.fail_after(90):
            await victim_dht.put_record("/lattica/ckpt/own", b"the node's own record")
            await connect(member, victim)
            await member_dht.bootstrap()
            await member_dht.provide(run_key("honest-run"))
            await _wait_for_provider(victim_dht, run_key("honest-run"), member.get_id())
            for n, attacker in enumerate(attackers):
                await connect(attacker, victim)
                for i in range(12):
                    await _acknowledged(attacker, victim, put_value_frame(f"/lattica/run/f{n}-{i}", b"y" * 1000))
                for i in range(3):
                    await _acknowledged(attacker, victim, add_provider_frame(attacker, content_key(b"f%d-%d" % (n, i))))
        stats = victim_dht.store_stats()
        assert stats.records <= limits.max_records
        assert stats.bytes <= limits.max_bytes
        assert stats.evicted > 0  # the later identities displaced the earlier ones' surplus
        records, _ = _attacker_records(victim_dht, attackers)
        assert records == stats.records - 1  # everything but the member's record is the flood's
        assert victim_dht.values.get(b"/lattica/ckpt/own") is not None
        assert member.get_id() in {p.peer_id for p in victim_dht.providers.get_providers(run_key("honest-run"))}
        held = len(victim_dht.values.store) - 1 + sum(
            len(r) for k, r in victim_dht.providers.providers.items() if k != run_key("honest-run")
        )
        assert held == records  # the stores hold exactly what the ledger accounts for


async def test_a_peer_dropped_for_bad_input_loses_the_records_it_stored():
    async with running_hosts(2) as (victim, attacker):
        victim_dht = LatticaDHT(victim, config=DHTConfig())
        with trio.fail_after(30):
            await connect(attacker, victim)
            for i in range(3):
                assert await _acknowledged(attacker, victim, put_value_frame(f"/lattica/ckpt/r{i}", b"v"))
            assert await _acknowledged(attacker, victim, add_provider_frame(attacker, content_key(b"c")))
            assert victim_dht.store_stats().records == 4
            await _acknowledged(attacker, victim, b"\x05hello")  # garbage: the peer is dropped
            while victim_dht.rejected_inputs == 0:
                await trio.sleep(0.05)
        assert victim_dht.store_stats().records == 0
        assert not victim_dht.values.store
        assert not victim_dht.providers.providers
