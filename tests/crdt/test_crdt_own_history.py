"""A writer restored from an older copy of its state: it supersedes its newer entries, never equivocates."""

from __future__ import annotations

import contextlib

import pytest
from crdt_helpers import RUN, make_replicas
from pycrdt import Doc

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate, sign_envelope
from lattica.crdt.replica import Replica


def _sync(src: Replica, dst: Replica) -> None:
    """One direction of an anti-entropy session; rejections are what a session would count."""
    for env in src.missing_for(dst.state_vector()):
        with contextlib.suppress(RejectedUpdate):
            dst.receive(env, from_peer=src.peer_id)


def _session(a: Replica, b: Replica) -> None:
    """Both directions, then each side settles its own streams as the service does."""
    _sync(a, b)
    _sync(b, a)
    for replica in (a, b):
        for env in replica.settle():
            assert env.full


def _progress(replica: Replica, rnd: int, digest: str | None = None) -> list:
    return replica.local_write(
        replica.peer_id, lambda d: documents.write_progress(d, round=rnd, weights_hash=digest or f"h{rnd}")
    )


def _restored(node: Replica, backup: list) -> Replica:
    """``node``'s key restarted from ``backup`` (what its log held then), as the service does it."""
    restored = Replica(run_id=RUN, key_pair=node.key_pair, admins=node.admins)
    for env in backup:
        restored.receive(env)
    restored.hold_own_streams()
    return restored


def _rounds(replica: Replica, writer: str) -> list[int]:
    return [c["round"] for c in replica.snapshot()["progress"][writer]["completed"]]


def test_a_restored_writer_supersedes_the_newer_entries_the_swarm_holds():
    node, other = make_replicas(2)
    _progress(node, 1)
    backup = node.retained()
    for rnd in range(2, 6):  # the life after the copy: the swarm holds these
        _progress(node, rnd)
    _sync(node, other)
    assert other.have(node.peer_id, node.peer_id) == 5

    restored = _restored(node, backup)
    _progress(restored, 2, "restored")  # written before any sync: kept, not published
    assert all(row[1] != node.peer_id for row in restored.state_vector())
    assert restored.missing_for(other.state_vector()) == []

    _session(other, restored)  # the other side sends all it holds of ours: absorbed
    assert restored.banned() == []
    assert other.banned() == []
    assert restored.counters()["superseded_own"] == 1
    head = restored.have(node.peer_id, node.peer_id)
    assert head == 6  # the seq after the highest one the swarm held
    _session(restored, other)
    assert other.have(node.peer_id, node.peer_id) == head
    assert "equivocation" not in other.rejected
    assert other.banned() == []
    # this life's entries win; the past life's rounds 3..5 (a state it no longer holds) are gone
    assert other.snapshot() == restored.snapshot()
    assert other.snapshot()["progress"][node.peer_id]["weights_hash"] == "restored"
    assert _rounds(other, node.peer_id) == [1, 2]
    # and the next writes follow on
    assert _progress(restored, 3)[0].seq == head + 1
    _session(restored, other)
    assert _rounds(other, node.peer_id) == [1, 2, 3][-documents.KEEP_COMPLETED_ROUNDS:]


def test_a_node_that_wrote_nothing_yet_fast_forwards_and_withdraws_its_past_claims():
    node, other = make_replicas(2)
    _progress(node, 1)
    backup = node.retained()
    _progress(node, 2)
    _sync(node, other)
    restored = _restored(node, backup)
    _session(other, restored)
    # round 2 was the past life's: its data dir (the copy) holds round 1
    assert restored.snapshot()["progress"][node.peer_id]["round"] == 1
    assert restored.have(node.peer_id, node.peer_id) == 3
    assert _progress(restored, 2, "again")[0].seq == 4
    _session(restored, other)
    assert other.banned() == []
    assert other.snapshot()["progress"][node.peer_id]["weights_hash"] == "again"


def test_a_plain_restart_publishes_as_before():
    node, other = make_replicas(2)
    _progress(node, 1)
    _sync(node, other)
    restarted = _restored(node, node.retained())  # its log is current
    _session(other, restarted)
    assert restarted.counters()["superseded_own"] == 0
    assert _progress(restarted, 2)[0].seq == 2


def test_a_fork_found_after_publishing_is_healed_at_every_replica():
    node, old_peer, newcomer = make_replicas(3)
    _progress(node, 1)
    backup = node.retained()
    _progress(node, 2, "past")
    _sync(node, old_peer)
    restored = _restored(node, backup)
    _progress(restored, 2, "now")
    _session(newcomer, restored)  # the first peer it meets knows nothing of it: it publishes
    _session(restored, newcomer)
    assert newcomer.snapshot()["progress"][node.peer_id]["weights_hash"] == "now"
    _session(newcomer, old_peer)  # the two histories meet: both ban the writer
    assert old_peer.banned() == [node.peer_id] == newcomer.banned()
    _session(restored, old_peer)  # the evidence reaches the writer: it supersedes both histories
    assert restored.banned() == []
    assert restored.counters()["superseded_own"] == 1
    for _ in range(2):
        for a, b in ((restored, old_peer), (restored, newcomer), (old_peer, newcomer)):
            _session(a, b)
    assert old_peer.banned() == [] == newcomer.banned()
    assert old_peer.snapshot() == newcomer.snapshot() == restored.snapshot()
    assert old_peer.snapshot()["progress"][node.peer_id]["weights_hash"] == "now"


def test_a_replica_holding_the_healing_snapshot_does_not_ban_for_the_old_pair():
    node, old_peer, observer = make_replicas(3)
    _progress(node, 1)
    backup = node.retained()
    past = _progress(node, 2, "past")
    _sync(node, old_peer)
    restored = _restored(node, backup)
    now = _progress(restored, 2, "now")
    _session(old_peer, restored)
    _session(restored, observer)  # the observer holds only the healing snapshot
    with pytest.raises(RejectedUpdate, match="replay"):
        observer.receive(past[0])  # a stale copy: older than what it holds
    with pytest.raises(RejectedUpdate, match="superseded"):
        observer.receive(now[0])
    assert observer.banned() == []


def test_a_snapshot_that_leaves_out_one_side_heals_nothing():
    liar, a = make_replicas(2)
    _progress(liar, 1)
    twin = Replica(run_id=RUN, key_pair=liar.key_pair, admins=liar.admins)
    for env in liar.retained():
        twin.receive(env)
    left, right = _progress(liar, 2, "left"), _progress(twin, 2, "right")
    for env in liar.retained():
        a.receive(env)
    with pytest.raises(RejectedUpdate, match="equivocation"):
        a.receive(right[0])
    # a later snapshot of one side only: still banned
    doc: Doc = Doc()
    for env in liar.retained():
        doc.apply_update(env.update)
    only_left = sign_envelope(liar.key_pair, run=RUN, doc=liar.peer_id, seq=9, full=True, update=doc.get_update())
    with pytest.raises(RejectedUpdate, match="banned"):
        a.receive(only_left)
    assert a.banned() == [liar.peer_id]
    assert left[0] != right[0]


def test_a_replica_never_bans_itself():
    node, other = make_replicas(2)
    _progress(node, 1)
    twin = Replica(run_id=RUN, key_pair=node.key_pair, admins=node.admins)
    fork = _progress(twin, 1, "elsewhere")  # the same key, written in another process
    with contextlib.suppress(RejectedUpdate):
        node.receive(fork[0], from_peer=other.peer_id)
    assert node.banned() == []
    assert node.holding  # it supersedes at its next settle
    assert node.settle()[0].seq == 2
