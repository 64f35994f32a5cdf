"""Sync version 2: news pushed to a few peers, rare full repairs, hellos that old daemons cannot misread."""

from __future__ import annotations

import random

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from test_crdt_service import LOOPBACK, p2p_addr, running_node, wait_for

from lattica.crdt.liveness import ProvenPeers
from lattica.crdt.sync import SYNC_PROTOCOL, hello, parse_hello
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
    vector: list[list[str | int]] = [["config", "admin", 3, "ab"], ["w1", "w1", 7, "cd"]]
    wire = hello("run", vector, partial=True)
    assert wire["sv"] == [["config", "admin", 3, "ab"], ["", "w1", 7, "cd"]]
    assert parse_hello(wire, run_id="run", peer_id="p") == (vector, True)


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "hello", "run": "run", "sv": []},  # version 1
        {"t": "hello", "v": 3, "run": "run", "part": False, "sv": []},
        {"t": "hello", "v": 2, "run": "run", "part": "yes", "sv": []},
        {"t": "hello", "v": 2, "run": "run", "part": False, "sv": [["", "", 1]]},
        {"t": "hello", "v": 2, "run": "run", "part": False, "sv": ["row"]},
        {"t": "hello", "v": 2, "run": "other", "part": False, "sv": []},
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
