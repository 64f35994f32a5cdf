"""Sync version 3: news pushed to a few peers, answers only where they differ, rare full repairs, hellos that
old daemons cannot misread."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from msgpack import packb
from test_crdt_service import LOOPBACK, p2p_addr, running_node, wait_for

from lattica.crdt import LeasePolicy, ReplicatedState, StateConfig, sync
from lattica.crdt.envelope import RejectedUpdate, envelope_from_wire, sign_envelope, verify_envelope
from lattica.crdt.liveness import ProvenPeers
from lattica.crdt.sync import (
    SYNC_PROTOCOL,
    as_answered,
    batches,
    differing,
    hello,
    parse_batch,
    parse_hello,
    resolved,
    writer_tag,
)
from lattica.crdt.sync_plan import News, SyncPlan, SyncPolicy
from lattica.errors import RemoteProtocolError
from lattica.net.host import build_host
from lattica.net.wire import read_message, write_message

PEERS = [f"peer-{i}" for i in range(64)]


def test_a_node_pushes_to_a_few_peers_per_period_and_repairs_with_one_now_and_then():
    policy = SyncPolicy(fanout=3, repair_interval_s=30.0)
    plan = SyncPlan(policy, rng=random.Random(1))
    first = plan.due(PEERS, 0.0, news=True, holding=False)
    assert len(first) == 3
    assert all(s.full for s in first)  # a newcomer: full sessions until one completes
    plan.completed(first[0])
    partial = full = 0
    for second in range(1, 601):
        sessions = plan.due(PEERS, float(second), news=True, holding=False)
        assert len({s.peer for s in sessions}) == len(sessions) <= policy.fanout + 1  # never all 64 peers
        partial += sum(not s.full for s in sessions)
        full += sum(s.full for s in sessions)
    assert 10 <= full <= 40  # one every 15-45 s
    assert partial >= 600 * 3 - full
    assert [s for s in plan.due(PEERS, 601.0, news=False, holding=False) if not s.full] == []  # nothing to push
    assert all(s.full for s in plan.due(PEERS, 602.0, news=True, holding=True))  # our streams are held
    assert len(plan.due(PEERS[:8], 603.0, news=True, holding=False)) == 8  # a small swarm: every peer


def test_news_are_the_streams_changed_within_the_window():
    news = News(1.5)
    news.note([("a", "a")], 10.0)
    news.note([("b", "b")], 11.0)
    assert news.keys(11.2) == {("a", "a"), ("b", "b")}
    assert news.keys(11.6) == {("b", "b")}
    news.note([("a", "a")], 12.0)
    assert news.keys(12.4) == {("a", "a"), ("b", "b")}
    assert news.keys(12.9) == {("a", "a")}
    assert news.keys(14.0) == set()


def test_a_hello_round_trips_with_its_rows_compacted():
    """A row names a writer by an 8-byte tag (not its 32-byte key or 52-character id) and the
    head by 8 bytes; a partial hello (a push) leaves the head out."""
    writer = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    vector: list[list[str | int]] = [["config", writer, 3, "00112233aabbccdd"], [writer, writer, 7, "ffeeddcc00112233"],
                                     ["config", "admin", 2, "ab"]]
    wire = hello("run", vector)
    tag = writer_tag(writer)
    assert len(tag) == 8
    assert wire["sv"][:2] == [["config", tag, 3, bytes.fromhex("00112233aabbccdd")],
                              ["", tag, 7, bytes.fromhex("ffeeddcc00112233")]]
    rows, partial = parse_hello(wire, run_id="run", peer_id="p")
    assert not partial
    assert resolved(rows, [writer, "admin", "someone else"]) == (vector, [])
    assert resolved(rows, ["admin"]) == ([vector[2]], rows[:2])  # a writer we do not know
    assert len(packb(wire["sv"][1])) <= 25  # 74 with the id and head spelled out, 47 with the key
    pushed = hello("run", vector, partial=True)
    assert pushed["sv"][1] == ["", tag, 7]
    assert len(packb(pushed["sv"][1])) <= 14


def test_the_answer_to_a_rumour_already_heard_is_empty():
    """A push's answer lists only the rows where the answerer differs: 47-byte rows echoed back
    at every push made each change cost a member its row ~9 times."""
    a, b, c = (ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(3))
    mine: list[list[str | int]] = [[a, a, 5, "aa" * 8], [b, b, 2, "bb" * 8], ["config", a, 1, "cc" * 8]]
    pushed = [[a, a, 5], [b, b, 2]]
    rows, partial = parse_hello(hello("run", pushed, partial=True), run_id="run", peer_id="p")
    assert partial
    theirs, unknown = resolved(rows, [a, b, c])
    assert differing(mine, theirs, unknown) == []  # heard it already
    assert packb(hello("run", differing(mine, theirs, unknown), partial=True)["sv"]) == packb([])
    behind = [[a, a, 4, "dd" * 8], ["config", a, 1, "cc" * 8]]  # an older seq of a, no b
    assert differing(behind, theirs, unknown) == [[a, a, 4], [b, b, 0]]
    theirs, unknown = resolved(rows, [b])  # a is a writer the answerer never heard of
    assert differing([[b, b, 2, "bb" * 8]], theirs, unknown) == [["", writer_tag(a), 0]]
    answer, _ = resolved(parse_hello(hello("run", [[a, a, 4], [b, b, 0]], partial=True), run_id="run",
                                     peer_id="p")[0], [a, b])
    assert as_answered(pushed, answer) == [[a, a, 4], [b, b, 0]]
    assert as_answered(pushed, []) == pushed  # an empty answer: it holds what we pushed


def test_a_tag_two_known_writers_share_names_neither(monkeypatch):
    """Tags of 8 bytes: two writers collide only when ground together (~2^32 tries); their rows
    then name neither, and their envelopes go whole, as to a peer that holds none."""
    rows = [["", b"12345678", 3]]
    real_tag = sync.writer_tag
    monkeypatch.setattr(sync, "writer_tag", lambda w: b"12345678" if w in ("x", "y") else real_tag(w))
    assert resolved(rows, ["x"]) == ([["x", "x", 3]], [])
    assert resolved(rows, ["x", "y"]) == ([], rows)


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "hello", "run": "run", "sv": []},  # version 1
        {"t": "hello", "v": 2, "run": "run", "part": False, "sv": []},  # version 2
        {"t": "hello", "v": 3, "run": "run", "part": "yes", "sv": []},
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": [["", "", 1]]},
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": [["", b"", 1]]},
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": [["", b"x" * 32, 1]]},  # a version-2 key
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": [[b"", b"x" * 8, 1]]},
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": [["", b"x" * 8]]},
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": ["row"]},
        {"t": "hello", "v": 3, "run": "other", "part": False, "sv": []},
    ],
)
def test_a_malformed_or_old_hello_is_refused(bad):
    with pytest.raises(RemoteProtocolError):
        parse_hello(bad, run_id="run", peer_id="p")


async def test_a_daemon_backs_off_a_peer_that_sends_a_version_1_hello(tmp_path):
    async with running_node(tmp_path, "a") as a:
        old = build_host(create_new_key_pair())
        async with old.run([LOOPBACK]):
            await old.connect(info_from_p2p_addr(p2p_addr(a)))
            stream = await old.new_stream(a.host.get_id(), [SYNC_PROTOCOL])
            await write_message(stream, {"t": "hello", "run": "svc", "sv": []})
            with pytest.raises(Exception), trio.fail_after(5):  # noqa: B017, PT011, PT012 - reset
                await read_message(stream, max_size=1 << 22)
                await read_message(stream, max_size=1 << 22)
            with pytest.raises(Exception):  # noqa: B017, PT011, PT012 - backed off: refused at once
                stream = await old.new_stream(a.host.get_id(), [SYNC_PROTOCOL])
                await write_message(stream, hello("svc", []))
                await read_message(stream)
            await wait_for(lambda: a.live_members() == [a.peer_id], [a])


def test_peers_whose_proof_ages_get_a_session_of_their_own():
    """A completed session proves a peer for a lease; a push to 3 of 64 peers a second would let
    many proofs lapse (and with them the standing that makes a member's vouches count)."""
    proven = ProvenPeers(lease_s=10.0)
    for peer in PEERS:
        proven.mark(peer, None, 0.0)
    assert proven.aging(PEERS, 4.0) == []
    proven.mark(PEERS[0], None, 5.0)
    aging = proven.aging(PEERS, 6.0)
    assert set(aging) == set(PEERS[1:])
    plan = SyncPlan(SyncPolicy(fanout=3), rng=random.Random(2))
    plan.completed(plan.due(PEERS, 0.0, news=True, holding=False)[0])
    sessions = plan.due(PEERS, 6.0, news=True, holding=False, refresh=aging)
    assert {s.peer for s in sessions} >= set(aging)
    assert sum(s.news for s in sessions) == 3  # the others carry no rows: a proof only


def test_a_small_swarm_syncs_with_each_peer_at_every_change_and_every_period():
    plan = SyncPlan(SyncPolicy(push_all_up_to=8), rng=random.Random(3))
    peers = PEERS[:8]
    assert plan.eager(peers)
    assert not plan.eager(PEERS[:9])
    first = plan.eager_due(peers, peers, 0.0, generation=1, period=1.0)
    assert [s.peer for s in first] == peers
    assert all(s.full for s in first)
    for peer in peers:
        plan.synced(peer, generation=1, now=0.1)
    assert plan.eager_due(peers, peers, 0.5, generation=1, period=1.0) == []  # nothing new
    assert plan.next_eager_at(peers, generation=1, period=1.0) == pytest.approx(1.1)
    assert len(plan.eager_due(peers, peers, 1.1, generation=1, period=1.0)) == 8  # the period's repair
    changed = plan.eager_due(peers, peers[:3], 0.6, generation=2, period=1.0)  # the others busy or backed off
    assert [s.peer for s in changed] == peers[:3]


@contextlib.asynccontextmanager
async def _node(tmp_path, name, config, *, admins=()):
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        state = ReplicatedState(host, key_pair, data_dir=tmp_path / name, run_id="svc",
                                config=dataclasses.replace(config, admins=tuple(admins)))
        await nursery.start(state.run)
        yield state
        nursery.cancel_scope.cancel()


async def test_a_small_swarm_sees_each_change_within_a_session_not_a_period(tmp_path):
    """Two nodes with a 10 s period: progress written three times in a row reaches the other at
    once each time. Waves of pushes (a larger swarm's) wait a period after each, so a member of a
    small swarm would see another's rounds or return seconds late."""
    config = StateConfig(lease=LeasePolicy(heartbeat_interval=10.0, lease=30.0), sync_interval=10.0,
                         peer_poll_interval=0.1, sync_timeout=3.0, max_backoff=1.0)
    async with _node(tmp_path, "a", config) as a, _node(tmp_path, "b", config, admins=(a.peer_id,)) as b:
        await a.host.connect(info_from_p2p_addr(p2p_addr(b)))
        a.notify_peer_connected(b.peer_id)
        await wait_for(lambda: a.snapshot() == b.snapshot() and len(b.live_members()) == 2, [a, b], timeout=25.0)
        for round_ in range(1, 4):
            await a.set_progress(round_, f"w{round_}")
            with trio.fail_after(2.0):
                while b.snapshot()["progress"].get(a.peer_id, {}).get("round") != round_:
                    await b.wait_changed()


def test_a_batch_sends_envelopes_without_what_the_receiver_derives():
    """Run, writer and a writer's own document are the session's and the key's: an envelope of a
    70-byte update takes 180 bytes, not 334, and arrives the same."""
    key_pair = create_new_key_pair()
    writer = ID.from_pubkey(key_pair.public_key).to_base58()
    env = sign_envelope(key_pair, run="run", doc=writer, seq=5, full=False, update=b"u" * 70)
    batch = batches([env])[0]
    assert len(packb(batch["envs"][0])) <= 200 < len(packb(env.to_wire()))
    raw = parse_batch(batch, peer_id="p", run_id="run")
    assert raw is not None
    received = envelope_from_wire(raw[0], max_update_bytes=1024)
    assert received == env
    verify_envelope(received, run="run")
    elsewhere = envelope_from_wire(parse_batch(batch, peer_id="p", run_id="other")[0], max_update_bytes=1024)
    with pytest.raises(RejectedUpdate):  # signed for another run
        verify_envelope(elsewhere, run="other")
    mangled = [["", 5, False, b"u", b"not a key", b"sig"], ["x"] * 6, 7]
    for item in parse_batch({"t": "envs", "envs": mangled}, peer_id="p", run_id="run"):
        with pytest.raises(RejectedUpdate):
            envelope_from_wire(item, max_update_bytes=1024)


def test_an_envelope_names_its_writer_by_tag_to_a_peer_that_holds_the_writer():
    """The key (36 bytes) follows from an Ed25519 writer's peer id: a receiver holding the
    writer's stream gets its 8-byte tag; one that does not, the key; a tag the receiver cannot
    resolve (a writer it forgot meanwhile) is skipped, not taken for bad input."""
    key_pair = create_new_key_pair()
    writer = ID.from_pubkey(key_pair.public_key).to_base58()
    env = sign_envelope(key_pair, run="run", doc=writer, seq=6, full=False, update=b"u" * 120)
    to_holder, to_newcomer = batches([env], holders={writer})[0], batches([env])[0]
    assert to_holder["envs"][0][4] == writer_tag(writer)
    assert to_newcomer["envs"][0][4] == env.key
    assert len(packb(to_holder["envs"][0])) <= len(packb(to_newcomer["envs"][0])) - 26
    raw = parse_batch(to_holder, peer_id="p", run_id="run", by_tag=sync.tags_of([writer, "other"]))
    received = envelope_from_wire(raw[0], max_update_bytes=1024)
    assert received == env
    verify_envelope(received, run="run")
    assert parse_batch(to_holder, peer_id="p", run_id="run", by_tag=sync.tags_of(["other"])) == []
