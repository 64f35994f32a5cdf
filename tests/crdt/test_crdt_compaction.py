"""A member's stream stays about the size of its current document, however long it has lived."""

from __future__ import annotations

import contextlib
import hashlib

from crdt_helpers import RUN, make_replicas
from msgpack import packb

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate
from lattica.crdt.replica import Replica
from lattica.crdt.sync import compact


def _live_for(replica: Replica, beats: int, *, rounds_every: int = 60) -> None:
    replica.local_write(replica.peer_id, lambda d: documents.write_member(
        d, {"addrs": ["/ip4/198.51.100.7/tcp/4001"], "role": "trainer", "device": "cpu"}))
    for beat in range(1, beats + 1):
        replica.local_write(replica.peer_id, lambda d, b=beat: documents.write_lease(
            d, lease_expires_ms=1_800_000_000_000 + b * 1000, heartbeat=b))
        if beat % rounds_every == 0:
            replica.local_write(replica.peer_id, lambda d, b=beat: documents.write_progress(
                d, round=b // rounds_every, weights_hash=f"{b:064x}"))


def _copy(src: Replica, dst: Replica) -> None:
    for env in src.missing_for(dst.state_vector()):
        with contextlib.suppress(RejectedUpdate):
            dst.receive(env, from_peer=src.peer_id)


def test_a_long_lived_member_holds_a_bounded_state_at_every_replica():
    writer, reader = make_replicas(2)
    _live_for(writer, 100)
    _copy(writer, reader)
    assert reader.state_bytes() <= 1024  # compacted long before snapshot_every envelopes
    _live_for(writer, 3000)  # an hour of lease renewals and fifty rounds more
    _copy(writer, reader)
    assert writer.state_bytes() <= 2048
    assert reader.state_bytes() <= 2048
    assert reader.snapshot()["members"][writer.peer_id]["heartbeat"] == 3000
    assert reader.snapshot()["progress"][writer.peer_id] == writer.snapshot()["progress"][writer.peer_id]


def test_a_replica_that_follows_increment_by_increment_ends_on_the_same_document():
    writer, follower, late = make_replicas(3)
    for _ in range(30):
        _live_for(writer, 10, rounds_every=5)
        _copy(writer, follower)
    _copy(writer, late)  # only the latest snapshot and what follows it
    assert follower.snapshot() == late.snapshot() == writer.snapshot()


def test_a_restart_recovers_the_compacted_stream():
    (writer,) = make_replicas(1)
    _live_for(writer, 500)
    restarted = Replica(run_id=RUN, key_pair=writer.key_pair, admins=writer.admins)
    for env in writer.retained():
        restarted.receive(env)
    assert restarted.snapshot() == writer.snapshot()
    restarted.local_write(writer.peer_id, lambda d: documents.write_lease(d, lease_expires_ms=1, heartbeat=501))
    assert restarted.snapshot()["members"][writer.peer_id]["heartbeat"] == 501


def test_a_member_record_keeps_only_its_last_rounds_hashes():
    (writer,) = make_replicas(1)
    for r in range(1, 11):
        hash_ = f"{r:064x}"
        writer.local_write(writer.peer_id, lambda d, r=r, h=hash_: documents.write_progress(d, round=r, weights_hash=h))
    progress = writer.snapshot()["progress"][writer.peer_id]
    assert [c["round"] for c in progress["completed"]] == [9, 10]
    assert all(c["weights_hash"] == f"{c['round']:064x}" for c in progress["completed"])
    assert (progress["round"], progress["weights_hash"]) == (10, f"{10:064x}")
    writer.local_write(writer.peer_id, lambda d: documents.write_progress(d, round=3, weights_hash="back"))
    progress = writer.snapshot()["progress"][writer.peer_id]  # restarted behind the rounds it keeps
    assert (progress["round"], progress["weights_hash"]) == (3, "back")
    writer.local_write(writer.peer_id, lambda d: documents.write_progress(d, round=11, weights_hash="h11"))
    assert writer.snapshot()["progress"][writer.peer_id]["weights_hash"] == "h11"


def test_a_round_s_progress_and_lease_renewal_take_one_small_envelope():
    """A member writes its progress and renews its lease with it once a round: the weights hash
    once (not also in ``progress``) and as its 32 bytes, the unchanged ``left`` flag not again —
    about 240 bytes on the wire where the same write took 363."""
    (writer,) = make_replicas(1)
    writer.local_write(writer.peer_id, lambda d: documents.write_lease(d, lease_expires_ms=1, heartbeat=1))
    sizes = []
    for r in range(1, 6):
        def renewed(d, r=r):
            documents.write_progress(d, round=r, weights_hash=hashlib.sha256(bytes([r])).hexdigest())
            documents.write_lease(d, lease_expires_ms=1_700_000_000_000 + r * 60_000, heartbeat=r + 1)
        sizes += [len(packb(compact(env))) for env in writer.local_write(writer.peer_id, renewed) if not env.full]
    assert max(sizes[1:]) <= 250
    progress = writer.snapshot()["progress"][writer.peer_id]
    assert progress["weights_hash"] == hashlib.sha256(bytes([5])).hexdigest()
