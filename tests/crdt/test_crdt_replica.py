"""The sans-IO replica: local writes, exact numbers, validation and counting of bad input."""

from __future__ import annotations

import dataclasses

import pytest
from crdt_helpers import RUN, make_replicas, peer_of
from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate, sign_envelope
from lattica.crdt.replica import Replica, ReplicaLimits
from lattica.errors import LocalProtocolError, RemoteProtocolError


def deliver_all(src: Replica, dst: Replica) -> int:
    applied = 0
    for env in src.missing_for(dst.state_vector()):
        applied += len(dst.receive(env, from_peer=src.peer_id))
    return applied


def test_writes_replicate_with_exact_integers(pair):
    a, b = pair
    big = 2**53 + 1  # not representable as float64
    a.local_write(
        a.peer_id,
        lambda d: documents.write_member(d, {"addrs": ["/ip4/127.0.0.1/tcp/1"], "device": "cpu", "role": "trainer"}),
    )
    a.local_write(a.peer_id, lambda d: documents.write_lease(d, lease_expires_ms=big, heartbeat=7))
    a.local_write(a.peer_id, lambda d: documents.write_progress(d, round=big, weights_hash="h1"))
    a.local_write(a.peer_id, lambda d: documents.write_checkpoint(d, round=3, hashes=["c1", "c2"], holder=a.peer_id))
    a.local_write(a.peer_id, lambda d: documents.write_expert(d, expert="layer3.e5", owned=True))
    a.local_write("config", lambda d: documents.write_config(d, {"lr": 0.7, "steps": big}))
    assert deliver_all(a, b) == 6
    snap = b.snapshot()
    assert snap == a.snapshot()
    member = snap["members"][a.peer_id]
    assert member["lease_expires_ms"] == big
    assert member["heartbeat"] == 7
    assert member["addrs"] == ["/ip4/127.0.0.1/tcp/1"]
    assert member["left"] is False
    assert member["role"] == "trainer"
    assert snap["progress"][a.peer_id]["round"] == big
    assert snap["progress"][a.peer_id]["completed"] == [{"round": big, "weights_hash": "h1"}]
    assert snap["checkpoints"] == {"3": {"c1": [a.peer_id], "c2": [a.peer_id]}}
    assert snap["experts"] == {"layer3.e5": [a.peer_id]}
    assert snap["config"] == {"lr": 0.7, "steps": big}


def test_local_write_permissions(pair):
    a, b = pair
    with pytest.raises(LocalProtocolError):
        b.local_write("config", lambda d: documents.write_config(d, {"x": 1}))
    with pytest.raises(LocalProtocolError):
        a.local_write(b.peer_id, lambda d: documents.write_expert(d, expert="e", owned=True))
    with pytest.raises(ValueError, match="unknown member fields"):
        documents.validate_member_fields({"admin": True})
    assert a.local_write(a.peer_id, lambda d: None) == []


def test_replay_is_idempotent_and_counted(pair):
    a, b = pair
    (env,) = a.local_write(a.peer_id, lambda d: documents.write_expert(d, expert="e", owned=True))
    assert b.receive(env) == [env]
    with pytest.raises(RejectedUpdate) as info:
        b.receive(env, from_peer="P")
    assert info.value.reason == "replay"
    assert info.value.peer_id == "P"
    assert b.counters()["updates_rejected"] == {"replay": 1}
    assert b.have(a.peer_id, a.peer_id) == 1
    assert b.snapshot() == a.snapshot()


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda env, other: dataclasses.replace(env, update=env.update + b"\x00"), "forged"),
        (lambda env, other: dataclasses.replace(env, sig=bytes(64)), "forged"),
        (lambda env, other: dataclasses.replace(env, key=other.public_key.serialize()), "forged"),
        (lambda env, other: dataclasses.replace(env, run="other-run"), "wrong_run"),
        (lambda env, other: dataclasses.replace(env, key=b"\x01garbage"), "malformed"),
    ],
)
def test_forged_envelopes_are_rejected(pair, tamper, reason):
    a, b = pair
    (env,) = a.local_write(a.peer_id, lambda d: documents.write_expert(d, expert="e", owned=True))
    bad = tamper(env, create_new_key_pair())
    with pytest.raises(RemoteProtocolError):
        b.receive(bad, from_peer=a.peer_id)
    assert b.counters()["updates_rejected"] == {reason: 1}
    assert b.snapshot()["experts"] == {}
    assert b.counters()["updates_accepted"] == 0


def test_writer_may_not_write_someone_elses_document():
    a, b, c = make_replicas(3)
    (env,) = b.local_write(b.peer_id, lambda d: documents.write_expert(d, expert="e", owned=True))
    # b signs an update for a's document and for the config doc: correctly signed, not allowed
    for doc in (a.peer_id, "config"):
        forged = sign_envelope(b.key_pair, run=RUN, doc=doc, seq=1, full=False, update=env.update)
        with pytest.raises(RejectedUpdate) as info:
            c.receive(forged)
        assert info.value.reason == "unauthorized"
    assert c.counters()["updates_rejected"] == {"unauthorized": 2}


def test_oversized_and_malformed_wire_input():
    limits = ReplicaLimits(max_update_bytes=1024, max_snapshot_bytes=2048, max_stream_bytes=4096)
    a, b = make_replicas(2, limits=limits)
    huge = sign_envelope(a.key_pair, run=RUN, doc=a.peer_id, seq=1, full=False, update=b"\x00" * 1500)
    with pytest.raises(RejectedUpdate, match="oversized"):
        b.receive_wire(huge.to_wire())
    with pytest.raises(RejectedUpdate, match="oversized"):
        b.receive_wire({**huge.to_wire(), "update": b"\x00" * 5000})
    for junk in [None, 5, {"seq": 1}, {**huge.to_wire(), "seq": "1"}, {**huge.to_wire(), "seq": 0}]:
        with pytest.raises(RejectedUpdate, match="malformed"):
            b.receive_wire(junk)
    garbage = sign_envelope(a.key_pair, run=RUN, doc=a.peer_id, seq=1, full=False, update=b"\xff" * 20)
    with pytest.raises(RejectedUpdate, match="bad_update"):
        b.receive(garbage)
    assert b.counters()["updates_rejected"] == {"oversized": 2, "malformed": 5, "bad_update": 1}
    assert b.state_vector() == []
    with pytest.raises(LocalProtocolError):
        a.local_write(a.peer_id, lambda d: documents.write_member(d, {"device": "x" * 500, "addrs": ["y" * 500] * 3}))


def test_a_second_signed_update_under_one_seq_is_an_equivocation(pair):
    a, b = pair
    (env,) = a.local_write(a.peer_id, lambda d: documents.write_expert(d, expert="e", owned=True))
    b.receive(env)
    other = sign_envelope(a.key_pair, run=RUN, doc=a.peer_id, seq=1, full=False, update=b"\x00\x00")
    with pytest.raises(RejectedUpdate, match="equivocation"):
        b.receive(other)
    assert b.banned() == [a.peer_id]


def test_out_of_order_arrivals_wait_for_their_predecessor(pair):
    a, b = pair
    envs = [
        a.local_write(a.peer_id, lambda d, i=i: documents.write_progress(d, round=i, weights_hash=f"h{i}"))[0]
        for i in range(5)
    ]
    for env in reversed(envs[1:]):
        assert b.receive(env) == []
    assert b.receive(envs[0]) == envs
    assert b.snapshot() == a.snapshot()


def test_snapshots_compact_streams_and_bring_newcomers_up_to_date():
    a, b = make_replicas(2, limits=ReplicaLimits(snapshot_every=4))
    for i in range(10):
        a.local_write(a.peer_id, lambda d, i=i: documents.write_lease(d, lease_expires_ms=i, heartbeat=i))
    retained = a.retained()
    assert retained[0].full
    assert len(retained) < 4
    assert a.have(a.peer_id, a.peer_id) == retained[-1].seq >= 13  # ten writes and at least three snapshots
    missing = a.missing_for(b.state_vector())
    assert missing == retained
    for env in missing:
        b.receive(env)
    assert b.snapshot() == a.snapshot()
    assert b.snapshot()["members"][a.peer_id]["heartbeat"] == 9


def test_untrusted_document_content_is_ignored_not_raised(pair):
    a, b = pair

    def hostile(doc):
        member = doc.get("member", type=documents.Map)
        member["lease_expires_ms"] = 1e300
        member["addrs"] = "not-a-list"
        member["left"] = "yes"
        doc.get("checkpoints", type=documents.Map)["nonsense"] = True
        doc.get("completed", type=documents.Map)["x"] = "h"

    a.local_write(a.peer_id, hostile)
    deliver_all(a, b)
    member = b.snapshot()["members"][a.peer_id]
    assert member["lease_expires_ms"] == 0
    assert member["addrs"] == []
    assert member["left"] is False
    assert b.snapshot()["checkpoints"] == {}


def test_peer_id_helper_matches_replica(pair):
    a, _ = pair
    assert a.peer_id == peer_of(a.key_pair)


def test_early_arrivals_are_buffered_within_bounds():
    a, b = make_replicas(2, limits=ReplicaLimits(max_pending_per_stream=2))
    envs = [
        a.local_write(a.peer_id, lambda d, i=i: documents.write_progress(d, round=i, weights_hash="h"))[0]
        for i in range(6)
    ]
    for env in envs[1:]:
        b.receive(env)  # only seq 2 and 3 fit in the buffer
    assert [e.seq for e in b.receive(envs[0])] == [1, 2, 3]
    assert b.have(a.peer_id, a.peer_id) == 3
    for env in a.missing_for(b.state_vector()):  # anti-entropy fetches the rest
        b.receive(env)
    assert b.snapshot() == a.snapshot()


def test_owned_experts_replace_the_writer_s_whole_set_in_one_update(pair):
    a, b = pair
    a.local_write(a.peer_id, lambda d: documents.write_owned_experts(d, ["0", "1", "2"]))
    b.local_write(b.peer_id, lambda d: documents.write_owned_experts(d, ["3"]))
    updates = a.local_write(a.peer_id, lambda d: documents.write_owned_experts(d, ["1", "2", "4"]))
    assert len(updates) == 1
    deliver_all(a, b)
    deliver_all(b, a)
    assert a.snapshot()["experts"] == b.snapshot()["experts"] == {
        "1": [a.peer_id], "2": [a.peer_id], "3": [b.peer_id], "4": [a.peer_id]
    }
    with pytest.raises(ValueError, match="expert"):
        a.local_write(a.peer_id, lambda d: documents.write_owned_experts(d, [""]))
