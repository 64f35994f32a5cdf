"""Members that left long ago are dropped from the state; one that comes back is taken again."""

from __future__ import annotations

import contextlib

from crdt_helpers import make_replicas

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate
from lattica.crdt.replica import Replica

HOUR_MS = 3_600_000


def _copy(src: Replica, dst: Replica) -> None:
    for env in src.missing_for(dst.state_vector()):
        with contextlib.suppress(RejectedUpdate):
            dst.receive(env, from_peer=src.peer_id)


def _beat(replica: Replica, *, expires_ms: int, beat: int, left: bool = False) -> None:
    replica.local_write(replica.peer_id, lambda d: documents.write_lease(
        d, lease_expires_ms=expires_ms, heartbeat=beat, left=left))


def test_a_replica_forgets_the_members_that_left_and_does_not_fetch_them_again():
    admin, keeper, lagging, *churned = make_replicas(23)
    _beat(keeper, expires_ms=10 * HOUR_MS, beat=1)
    for i, member in enumerate(churned):
        _beat(member, expires_ms=HOUR_MS, beat=1, left=i % 2 == 0)  # half left cleanly, half just stopped
    for source in (keeper, *churned):
        _copy(source, admin)
    _copy(admin, lagging)
    before = admin.state_bytes()

    gone = admin.forget_departed(admin.snapshot()["members"], now_ms=2 * HOUR_MS, after_ms=600_000)

    assert sorted(gone) == sorted(m.peer_id for m in churned)
    assert admin.writers() >= {keeper.peer_id}
    assert not admin.writers() & set(gone)
    assert admin.state_bytes() < before / 5
    _copy(lagging, admin)  # a peer that has not forgotten them yet offers them again
    assert not admin.writers() & set(gone)
    assert not admin.wants_from(lagging.state_vector())


def test_a_forgotten_member_that_comes_back_is_a_member_again():
    admin, member = make_replicas(2)
    _beat(member, expires_ms=HOUR_MS, beat=1)
    _copy(member, admin)
    admin.forget_departed(admin.snapshot()["members"], now_ms=2 * HOUR_MS, after_ms=600_000)
    for beat in range(2, 2 + member.limits.snapshot_every):  # until its next snapshot
        _beat(member, expires_ms=3 * HOUR_MS, beat=beat)
    _copy(member, admin)
    assert admin.snapshot()["members"][member.peer_id]["heartbeat"] == 1 + member.limits.snapshot_every


def test_a_member_that_left_cleanly_stays_known_as_left_until_the_delay_has_passed():
    """A clean leave writes no time (its lease is 0): the delay runs from when it was first seen gone."""
    admin, leaver = make_replicas(2)
    _beat(leaver, expires_ms=0, beat=1, left=True)
    _copy(leaver, admin)
    members = admin.snapshot()["members"]
    assert admin.forget_departed(members, now_ms=2 * HOUR_MS, after_ms=600_000) == []
    assert admin.forget_departed(members, now_ms=2 * HOUR_MS + 599_000, after_ms=600_000) == []
    assert admin.snapshot()["members"][leaver.peer_id]["left"] is True
    assert admin.forget_departed(members, now_ms=2 * HOUR_MS + 601_000, after_ms=600_000) == [leaver.peer_id]
