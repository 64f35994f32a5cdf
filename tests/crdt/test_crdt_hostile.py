"""Hostile writers against the sans-IO replica: equivocation, throwaway keys, stale early arrivals."""

from __future__ import annotations

import contextlib

import pytest
from crdt_helpers import RUN, make_replicas, peer_of
from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate, sign_envelope
from lattica.crdt.replica import Replica, ReplicaLimits


def _sync(src: Replica, dst: Replica) -> None:
    """One direction of an anti-entropy session; rejections are what a session would count."""
    for env in src.missing_for(dst.state_vector()):
        with contextlib.suppress(RejectedUpdate):
            dst.receive(env, from_peer=src.peer_id)


def _progress(replica: Replica, rnd: int) -> list:
    return replica.local_write(
        replica.peer_id, lambda d: documents.write_progress(d, round=rnd, weights_hash=f"h{rnd}"),
    )


def _forked(liar: Replica, seq_from: int = 1):
    """Two different histories of ``liar``'s document, signed under the same seqs."""
    base = _progress(liar, 1)
    twin = Replica(run_id=RUN, key_pair=liar.key_pair, admins=liar.admins)
    for env in base:
        twin.receive(env)
    return base + _progress(liar, 7), base + _progress(twin, 9)


def test_an_equivocating_writer_is_banned_by_every_replica_whichever_history_it_saw():
    liar, a, b, c = make_replicas(4)
    left, right = _forked(liar)
    for env in left:
        a.receive(env)
        c.receive(env)
    for env in right:
        b.receive(env)  # a and b each hold a consistent, different history of the liar
    assert a.snapshot()["progress"][liar.peer_id]["round"] == 7
    assert b.snapshot()["progress"][liar.peer_id]["round"] == 9
    _progress(a, 3)
    _progress(b, 4)

    # anti-entropy alone: a sends b the liar's seq 2, b sees the fork and bans; the evidence then
    # reaches a and c, whose history of the liar was the same and consistent
    for _ in range(3):
        for src, dst in ((a, b), (b, a), (a, c), (c, a), (b, c), (c, b)):
            _sync(src, dst)
    for replica in (a, b, c):
        assert replica.banned() == [liar.peer_id]
        assert liar.peer_id not in replica.snapshot()["progress"]
        assert all(row[1] != liar.peer_id for row in replica.state_vector())
    assert a.snapshot() == b.snapshot() == c.snapshot()
    # the liar's later envelopes are refused (and never penalize the peer relaying them)
    with pytest.raises(RejectedUpdate, match="banned"):
        a.receive(_progress(liar, 8)[0])
    assert not a.wants_from(liar.state_vector())


def test_a_fork_is_spotted_among_early_arrivals():
    liar, a = make_replicas(2)
    left, right = _forked(liar)
    # both forks' seq-2 envelopes arrive before seq 1: the second differs from the buffered one
    assert a.receive(left[-1]) == []
    with pytest.raises(RejectedUpdate, match="equivocation"):
        a.receive(right[-1])
    assert a.banned() == [liar.peer_id]
    assert a.pending_count() == 0


def test_ban_evidence_survives_a_rebuild_from_retained():
    liar, a = make_replicas(2)
    left, right = _forked(liar)
    for env in left:
        a.receive(env)
    with pytest.raises(RejectedUpdate, match="equivocation"):
        a.receive(right[-1])
    evidence = a.take_new_evidence()
    assert len(evidence) == 2
    assert a.take_new_evidence() == []
    # a restart replays the durable log, which holds what ``retained`` returns
    fresh = Replica(run_id=RUN, key_pair=a.key_pair, admins=a.admins)
    for env in a.retained():
        with contextlib.suppress(RejectedUpdate):
            fresh.receive(env)
    assert fresh.banned() == [liar.peer_id]
    assert fresh.snapshot() == a.snapshot()


def test_an_admin_ban_keeps_the_other_admins_config():
    honest, liar, a = make_replicas(3, admin_count=2)
    honest.local_write("config", lambda d: documents.write_config(d, {"lr": 1}))
    first = liar.local_write("config", lambda d: documents.write_config(d, {"x": 1}))
    forged = sign_envelope(liar.key_pair, run=RUN, doc="config", seq=1, full=False, update=b"\x00\x00")
    for env in honest.retained() + first:
        a.receive(env)
    with pytest.raises(RejectedUpdate, match="equivocation"):
        a.receive(forged)
    assert a.snapshot()["config"] == {"lr": 1}


def test_throwaway_writers_cannot_lock_out_trusted_ones():
    trusted: set[str] = set()
    limits = ReplicaLimits(max_streams=4)
    member, observer = make_replicas(2, limits=limits)
    observer.trusted = trusted.__contains__
    trusted.add(member.peer_id)
    _progress(member, 1)
    _sync(member, observer)
    phantoms = [make_replicas(1)[0] for _ in range(10)]
    for phantom in phantoms:
        _progress(phantom, 999)
        _sync(phantom, observer)  # each evicts the oldest phantom once the table is full
    writers = observer.writers()
    assert len(writers) == 4
    assert member.peer_id in writers
    assert writers - {member.peer_id} == {p.peer_id for p in phantoms[-3:]}
    # an evicted phantom is refused, and a peer offering it again gives no reason to sync
    with pytest.raises(RejectedUpdate, match="evicted"):
        observer.receive(phantoms[0].retained()[0])
    assert not observer.wants_from(phantoms[0].state_vector())
    # a newcomer that proves itself later is taken, even though the table is full
    newcomer = make_replicas(1)[0]
    _progress(newcomer, 2)
    trusted.add(newcomer.peer_id)
    _sync(newcomer, observer)
    assert newcomer.peer_id in observer.writers()
    assert member.peer_id in observer.writers()


def test_a_table_of_trusted_writers_still_refuses_more():
    a, b, c = make_replicas(3, limits=ReplicaLimits(max_streams=1))
    b.trusted = lambda writer: True
    _progress(a, 1)
    _progress(c, 1)
    _sync(a, b)
    with pytest.raises(RejectedUpdate, match="too_many_writers"):
        b.receive(c.retained()[0])


def test_early_arrivals_expire():
    a, b = make_replicas(2, limits=ReplicaLimits(pending_ttl=10.0))
    envs = [_progress(a, i)[0] for i in range(4)]
    b.tick(100.0)
    for env in envs[2:]:
        assert b.receive(env) == []
    assert b.pending_count() == 2
    assert b.tick(105.0) == 0
    assert b.tick(110.5) == 2
    assert b.pending_count() == 0
    assert b.receive(envs[0]) == envs[:1]  # the rest is fetched again by anti-entropy
    _sync(a, b)
    assert b.snapshot() == a.snapshot()


def test_pending_ttl_must_be_positive():
    with pytest.raises(ValueError, match="pending_ttl"):
        ReplicaLimits(pending_ttl=0)
    assert peer_of(create_new_key_pair()) != ""
