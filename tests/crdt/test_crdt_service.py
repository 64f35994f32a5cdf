"""ReplicatedState on real libp2p hosts over loopback, in one process."""

from __future__ import annotations

import contextlib
import dataclasses

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.crdt import LeasePolicy, ReplicatedState, StateConfig
from lattica.crdt.envelope import sign_envelope
from lattica.crdt.sync import SYNC_PROTOCOL, hello
from lattica.errors import LocalProtocolError
from lattica.net.host import build_host
from lattica.net.wire import read_message, write_message

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
FAST = dict(
    lease=LeasePolicy(heartbeat_interval=0.2, lease=4.0, clock_skew=0.0),
    sync_interval=0.3,
    peer_poll_interval=0.1,
    sync_timeout=3.0,
    max_backoff=1.0,
)


@contextlib.asynccontextmanager
async def running_node(tmp_path, name, *, admins=()):
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        config = StateConfig(admins=tuple(admins), **FAST)
        state = ReplicatedState(host, key_pair, data_dir=tmp_path / name, run_id="svc", config=config)
        await nursery.start(state.run)
        yield state
        nursery.cancel_scope.cancel()


def p2p_addr(state: ReplicatedState) -> multiaddr.Multiaddr:
    return state.host.get_addrs()[0]


async def connect(a: ReplicatedState, b: ReplicatedState) -> None:
    await a.host.connect(info_from_p2p_addr(p2p_addr(b)))


async def wait_for(predicate, states, timeout=15.0):
    with trio.fail_after(timeout):
        while not predicate():
            with trio.move_on_after(0.2):
                async with trio.open_nursery() as nursery:
                    for s in states:
                        nursery.start_soon(s.wait_changed)
                    await trio.sleep(0.2)


async def test_three_nodes_converge_through_a_relay_node_and_see_a_leave(tmp_path):
    async with running_node(tmp_path, "a") as a:
        admins = (a.peer_id,)
        async with running_node(tmp_path, "b", admins=admins) as b, running_node(tmp_path, "c", admins=admins) as c:
            nodes = [a, b, c]
            await a.update_member(addrs=[str(p2p_addr(a))], device="cpu", throughput=12.5, reachability="public")
            await a.set_run_config({"model": "tiny", "outer_lr": 0.7, "total_tokens": 2**60})
            await c.set_progress(3, "w3")
            with pytest.raises(LocalProtocolError):
                await b.set_run_config({"model": "evil"})
            await connect(a, b)  # line topology: a - b - c
            await connect(b, c)
            everyone = sorted(n.peer_id for n in nodes)
            await wait_for(lambda: all(n.live_members() == everyone for n in nodes), nodes)
            await wait_for(lambda: all(n.snapshot() == a.snapshot() for n in nodes), nodes)
            snap = c.snapshot()
            assert snap["config"] == {"model": "tiny", "outer_lr": 0.7, "total_tokens": 2**60}
            assert snap["members"][a.peer_id]["throughput"] == 12.5
            assert snap["progress"][c.peer_id]["round"] == 3

            start = trio.current_time()
            await c.leave()
            rest = sorted([a.peer_id, b.peer_id])
            await wait_for(lambda: a.live_members() == rest and b.live_members() == rest, nodes)
            assert trio.current_time() - start < 3.0  # before the 4 s lease could run out
            assert a.snapshot()["members"][c.peer_id]["left"] is True


async def test_partition_heals_by_anti_entropy(tmp_path):
    async with running_node(tmp_path, "a") as a, running_node(tmp_path, "b", admins=(a.peer_id,)) as b:
        for i in range(5):  # written while the two are not connected
            await a.add_checkpoint(i, [f"ca{i}"])
            await b.set_expert_owner(f"e{i}")
        await connect(a, b)
        await wait_for(lambda: a.snapshot() == b.snapshot() and len(a.snapshot()["checkpoints"]) == 5, [a, b])
        assert sorted(b.snapshot()["experts"]) == [f"e{i}" for i in range(5)]
        assert a.counters()["updates_rejected"].keys() <= {"replay"}


async def test_hostile_peer_is_rejected_counted_and_harmless(tmp_path):
    async with running_node(tmp_path, "a") as a:
        mallory_keys = create_new_key_pair()
        mallory = build_host(mallory_keys)
        async with mallory.run([LOOPBACK]):
            await mallory.connect(info_from_p2p_addr(p2p_addr(a)))
            before = a.snapshot()
            # a correctly signed update for a's own document, but signed by mallory
            forged = sign_envelope(mallory_keys, run="svc", doc=a.peer_id, seq=99, full=False, update=b"\x00\x00")
            forged = dataclasses.replace(forged, writer=a.peer_id)
            stream = await mallory.new_stream(a.host.get_id(), [SYNC_PROTOCOL])
            await write_message(stream, hello("svc", []))
            with trio.fail_after(5):
                await read_message(stream, max_size=1 << 22)  # a's hello
                while (await read_message(stream, max_size=1 << 22))["t"] != "end":
                    pass
                await write_message(stream, {"t": "envs", "envs": [forged.to_wire()]})
                await write_message(stream, {"t": "end"})
            await wait_for(lambda: a.counters()["updates_rejected"].get("forged") == 1, [a])
            # mallory is now backed off: its next session is refused
            with pytest.raises(Exception):  # noqa: B017, PT011, PT012 - StreamFailure or a reset
                stream = await mallory.new_stream(a.host.get_id(), [SYNC_PROTOCOL])
                await write_message(stream, hello("svc", []))
                await read_message(stream)
            await trio.sleep(1.1)  # max_backoff
            # an oversized frame is refused: the stream is reset, nothing else happens
            stream = await mallory.new_stream(a.host.get_id(), [SYNC_PROTOCOL])
            await stream.write((1 << 30).to_bytes(4, "big") + b"x" * 100)
            with pytest.raises(Exception), trio.fail_after(5):  # noqa: B017, PT011, PT012
                await read_message(stream, max_size=1 << 22)
                await read_message(stream, max_size=1 << 22)
            assert set(a.snapshot()["members"]) == set(before["members"]) == {a.peer_id}
            assert a.live_members() == [a.peer_id]


async def test_a_member_s_progress_renews_its_lease_in_the_same_envelope(tmp_path):
    """Every write of its record renews a member's lease, and the next renewal of its own falls
    due an interval after it: a member publishing rounds faster than it renews writes one
    envelope per round (rounds and renewals were two envelopes, every member receiving both)."""
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    config = StateConfig(**{**FAST, "lease": LeasePolicy(heartbeat_interval=0.5, lease=2.0, clock_skew=0.0)})
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        state = ReplicatedState(host, key_pair, data_dir=tmp_path / "a", run_id="svc", config=config)
        await nursery.start(state.run)
        first = state.snapshot()["members"][state.peer_id]
        for round_ in range(1, 11):
            await trio.sleep(0.2)
            await state.set_progress(round_, f"w{round_}")
        record = state.snapshot()["members"][state.peer_id]
        assert record["heartbeat"] == first["heartbeat"] + 10  # one renewal per round, none of its own
        assert record["lease_expires_ms"] >= first["lease_expires_ms"] + 1800
        assert state.counters()["updates_accepted"] <= 12
        await trio.sleep(0.8)  # no round for more than an interval: a renewal of its own
        assert state.snapshot()["members"][state.peer_id]["heartbeat"] == record["heartbeat"] + 1
        nursery.cancel_scope.cancel()
