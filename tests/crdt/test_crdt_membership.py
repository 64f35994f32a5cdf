"""Membership against a hostile member, on real libp2p hosts: throwaway keys and equivocation."""

from __future__ import annotations

import contextlib
import itertools
import time

import multiaddr
import pytest
import trio
from crdt_helpers import peer_of
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from test_crdt_service import FAST, LOOPBACK, connect, p2p_addr, running_node, wait_for

from lattica.crdt import ReplicatedState, StateConfig, documents
from lattica.crdt.envelope import Envelope
from lattica.crdt.liveness import VouchPolicy
from lattica.crdt.replica import Replica, ReplicaLimits
from lattica.crdt.sync import SYNC_PROTOCOL, hello
from lattica.net.host import build_host
from lattica.net.wire import read_message, write_message

RUN = "svc"
FAR_LEASE_MS = 2_085_000_000_000  # 2036


def phantom_envelopes(*, vouch_for: list[str] = ()) -> tuple[str, list[Envelope]]:
    """A throwaway key's record: a trainer with a lease until 2036, at round 999."""
    replica = Replica(run_id=RUN, key_pair=create_new_key_pair(), admins=())
    me = replica.peer_id
    envs = replica.local_write(
        me, lambda d: documents.write_member(d, {"role": "trainer", "addrs": ["/ip4/10.9.9.9/tcp/1"]}),
    )
    envs += replica.local_write(me, lambda d: documents.write_lease(d, lease_expires_ms=FAR_LEASE_MS, heartbeat=1))
    envs += replica.local_write(me, lambda d: documents.write_progress(d, round=999, weights_hash="f" * 64))
    if vouch_for:
        envs += replica.local_write(me, lambda d: documents.write_vouches(d, vouch_for))
    return me, envs


async def push(host, target, envelopes: list[Envelope], *, timeout: float = 30.0) -> None:
    """One sync session from ``host`` that offers ``envelopes`` to ``target`` (a bound on the
    whole session, not a pace: a loaded machine takes longer to read a large batch)."""
    stream = await host.new_stream(target.host.get_id(), [SYNC_PROTOCOL])
    with trio.fail_after(timeout):
        await write_message(stream, hello(RUN, []))
        await read_message(stream, max_size=1 << 22)
        while (await read_message(stream, max_size=1 << 22))["t"] != "end":
            pass
        await write_message(stream, {"t": "envs", "envs": [e.to_wire() for e in envelopes]})
        await write_message(stream, {"t": "end"})
    await stream.close()


async def test_records_of_throwaway_keys_are_never_live_members(tmp_path):
    async with running_node(tmp_path, "a") as a, running_node(tmp_path, "b", admins=(a.peer_id,)) as b:
        await connect(a, b)
        mallory_keys = create_new_key_pair()
        mallory = build_host(mallory_keys)
        mallory_id = peer_of(mallory_keys)
        async with mallory.run([LOOPBACK]):
            await mallory.connect(info_from_p2p_addr(p2p_addr(a)))
            # mallory, a member, signs records with fresh keys, and a record of its own that
            # vouches for them
            phantoms, envelopes = [], []
            for _ in range(4):
                peer, envs = phantom_envelopes()
                phantoms.append(peer)
                envelopes += envs
            mallory_replica = Replica(run_id=RUN, key_pair=mallory_keys, admins=())
            envelopes += mallory_replica.local_write(
                mallory_id, lambda d: documents.write_lease(d, lease_expires_ms=FAR_LEASE_MS, heartbeat=1),
            )
            envelopes += mallory_replica.local_write(mallory_id, lambda d: documents.write_vouches(d, phantoms))
            await push(mallory, a, envelopes)

            def spread() -> bool:  # b holds the phantoms too (a relayed them)
                return all(p in b.snapshot()["members"] for p in phantoms)

            await wait_for(spread, [a, b])
            for node in (a, b):
                assert set(phantoms) <= set(node.dump()["unverified"])
                assert not set(phantoms) & set(node.live_members())
                assert node.peer_id in node.live_members()
            assert sorted(a.live_members()) == sorted([a.peer_id, b.peer_id])  # mallory's lease: 2036
            await wait_for(lambda: a.peer_id in b.live_members() and b.peer_id in a.live_members(), [a, b])
            # the throwaway keys never connected: a full table evicts them before any member
            assert all(a._trusted(p) is False for p in phantoms)
            assert a._trusted(b.peer_id)


async def test_an_equivocating_writer_is_banned_everywhere_and_the_ban_survives_a_restart(tmp_path):
    async with running_node(tmp_path, "a") as a, running_node(tmp_path, "b", admins=(a.peer_id,)) as b:
        liar_keys = create_new_key_pair()
        liar = build_host(liar_keys)
        liar_id = peer_of(liar_keys)
        one = Replica(run_id=RUN, key_pair=liar_keys, admins=())
        two = Replica(run_id=RUN, key_pair=liar_keys, admins=())
        left = one.local_write(liar_id, lambda d: documents.write_progress(d, round=5, weights_hash="left"))
        right = two.local_write(liar_id, lambda d: documents.write_progress(d, round=6, weights_hash="right"))
        assert left[0].seq == right[0].seq == 1
        async with liar.run([LOOPBACK]):
            await liar.connect(info_from_p2p_addr(p2p_addr(a)))
            await liar.connect(info_from_p2p_addr(p2p_addr(b)))
            await push(liar, a, left)  # a different history to each
            await push(liar, b, right)
            def holds(node, weights_hash: str) -> bool:
                return node.snapshot()["progress"].get(liar_id, {}).get("weights_hash") == weights_hash

            await wait_for(lambda: holds(a, "left") and holds(b, "right"), [a, b])
            await connect(a, b)
            await wait_for(lambda: a.dump()["banned"] == b.dump()["banned"] == [liar_id], [a, b])
            await wait_for(lambda: a.snapshot() == b.snapshot(), [a, b])
            assert liar_id not in a.snapshot()["progress"]
            # the honest peers relayed what they held: neither was penalized for it
            await a.set_progress(1, "h1")
            await wait_for(lambda: b.snapshot()["progress"].get(a.peer_id, {}).get("round") == 1, [a, b])
    # restarted from its log, a still bans the liar
    async with running_node(tmp_path, "a") as again:
        assert again.dump()["banned"] == [liar_id]
        assert liar_id not in again.snapshot()["progress"]
        with pytest.raises(KeyError):
            again.snapshot()["members"][liar_id]


@contextlib.asynccontextmanager
async def _small_table_node(tmp_path, name, *, max_streams: int):
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        config = StateConfig(**{**FAST, "limits": ReplicaLimits(max_streams=max_streams)})
        state = ReplicatedState(host, key_pair, data_dir=tmp_path / name, run_id=RUN, config=config)
        await nursery.start(state.run)
        yield state
        nursery.cancel_scope.cancel()


async def test_a_flood_of_throwaway_writers_locks_no_member_out(tmp_path):
    # signed before the nodes start: signing 900 records blocks the event loop for seconds on a
    # loaded machine, and the nodes' leases (4 s) would run out meanwhile
    envelopes = [env for _ in range(300) for env in phantom_envelopes()[1]]
    async with _small_table_node(tmp_path, "a", max_streams=32) as a, running_node(tmp_path, "b") as b:
        await connect(a, b)
        await b.set_progress(1, "h1")
        await wait_for(lambda: b.peer_id in a.live_members(), [a, b])
        flooder = build_host(create_new_key_pair())
        async with flooder.run([LOOPBACK]):
            await flooder.connect(info_from_p2p_addr(p2p_addr(a)))
            await push(flooder, a, envelopes)
            # the flood is dealt with (every writer past the table's room evicted) within a bound
            # that holds on a loaded machine; the table never grows past its room meanwhile
            await wait_for(lambda: a.counters()["evicted_writers"] >= 300 - 32, [a], timeout=60)
            assert a.counters()["streams"] <= 32
            # the member that was there keeps its place, and one that comes later gets in
            await b.set_progress(2, "h2")
            await wait_for(lambda: a.snapshot()["progress"].get(b.peer_id, {}).get("round") == 2, [a, b], timeout=30)
            async with running_node(tmp_path, "c") as c:
                await c.set_progress(3, "h3")
                await connect(c, a)
                await wait_for(
                    lambda: a.snapshot()["progress"].get(c.peer_id, {}).get("round") == 3, [a, c], timeout=30,
                )
                # live: leases renewed every 0.2 s; one late renewal under load is waited out
                await wait_for(lambda: {b.peer_id, c.peer_id} <= set(a.live_members()), [a, b, c], timeout=30)


@contextlib.asynccontextmanager
async def _node_at(tmp_path, name: str, ip: str, *, vouching: VouchPolicy | None = None):
    """A node listening on its own loopback address: peers that dial it see that address."""
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    async with host.run([multiaddr.Multiaddr(f"/ip4/{ip}/tcp/0")]), trio.open_nursery() as nursery:
        config = StateConfig(**FAST, vouching=vouching or VouchPolicy())
        state = ReplicatedState(host, key_pair, data_dir=tmp_path / name, run_id=RUN, config=config)
        await nursery.start(state.run)
        yield state
        nursery.cancel_scope.cancel()


async def _renew_leases(phantoms: list[Replica], relays: list[ReplicatedState]) -> None:
    """The throwaway keys' owner renews their leases and hands the records to its members."""
    for beat in itertools.count(1):
        expires = time.time_ns() // 1_000_000 + 4000
        for p in phantoms:
            p.local_write(
                p.peer_id, lambda d, b=beat, e=expires: documents.write_lease(d, lease_expires_ms=e, heartbeat=b),
            )
        wire = [env.to_wire() for p in phantoms for env in p.retained()]
        for relay in relays:
            await relay.accept_batch(wire, from_peer=relay.peer_id)
        await trio.sleep(0.5)


async def test_members_on_one_network_vouch_nobody_in_but_members_at_two_do(tmp_path):
    """Two members on one network list throwaway keys whose leases they keep renewing: the keys
    stay unverified. A member reached only through two members on two other networks counts,
    once those have proved themselves for the standing the policy asks (2 s here)."""
    policy = VouchPolicy(min_standing_s=2.0)
    phantoms = [Replica(run_id=RUN, key_pair=create_new_key_pair(), admins=()) for _ in range(3)]
    phantom_ids = {p.peer_id for p in phantoms}
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(_node_at(tmp_path, "a", "127.0.0.1", vouching=policy))
        v1 = await stack.enter_async_context(_node_at(tmp_path, "v1", "127.0.1.1"))
        v2 = await stack.enter_async_context(_node_at(tmp_path, "v2", "127.0.2.1"))
        m1 = await stack.enter_async_context(_node_at(tmp_path, "m1", "127.0.3.1"))
        m2 = await stack.enter_async_context(_node_at(tmp_path, "m2", "127.0.3.1"))
        c = await stack.enter_async_context(_node_at(tmp_path, "c", "127.0.0.1"))
        for member in (m1, m2):  # each lists the throwaway keys as proven to it
            member.proven_peers = lambda real=member.proven_peers: real() | phantom_ids  # type: ignore[method-assign]
        for member in (v1, v2, m1, m2):
            await connect(a, member)
        await connect(v1, c)  # c: reached only through v1 and v2
        await connect(v2, c)
        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(_renew_leases, phantoms, [m1, m2])
        await wait_for(lambda: phantom_ids <= set(a.snapshot()["members"]), [a], timeout=20)
        await wait_for(lambda: c.peer_id in a.live_members(), [a], timeout=30)
        proofs = a.proofs()
        assert proofs[m1.peer_id].origin == proofs[m2.peer_id].origin == "127.0.3.0/24"
        assert proofs[v1.peer_id].origin != proofs[v2.peer_id].origin


        def seasoned() -> bool:
            proofs = a.proofs()
            return all(p in proofs and proofs[p].standing_s >= policy.min_standing_s for p in (m1.peer_id, m2.peer_id))

        await wait_for(seasoned, [a], timeout=20)
        with trio.move_on_after(3.0):  # a few more heartbeats and renewals: still nobody
            while True:
                assert not phantom_ids & set(a.live_members())
                await trio.sleep(0.1)
        assert phantom_ids <= set(a.dump()["unverified"])
        assert c.peer_id in a.live_members()
        nursery.cancel_scope.cancel()
