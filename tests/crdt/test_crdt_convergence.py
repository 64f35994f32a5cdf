"""Property: replicas that exchange envelopes in any order, with duplicates, losses and
partitions, end in identical state once anti-entropy runs over a healed network."""

from __future__ import annotations

from crdt_helpers import make_replicas
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lattica.crdt import documents
from lattica.crdt.envelope import RejectedUpdate
from lattica.crdt.replica import Replica, ReplicaLimits

WRITE_KINDS = ("member", "lease", "progress", "checkpoint", "expert", "config")


def apply_write(replica: Replica, kind: str, value: int) -> None:
    me = replica.peer_id
    if kind == "member":
        replica.local_write(me, lambda d: documents.write_member(d, {"device": f"gpu{value}", "throughput": value / 3}))
    elif kind == "lease":
        replica.local_write(
            me,
            lambda d: documents.write_lease(d, lease_expires_ms=2**60 + value, heartbeat=value, left=value % 5 == 0),
        )
    elif kind == "progress":
        replica.local_write(me, lambda d: documents.write_progress(d, round=value, weights_hash=f"w{value}"))
    elif kind == "checkpoint":
        replica.local_write(
            me, lambda d: documents.write_checkpoint(d, round=value % 3, hashes=[f"c{value}"], holder=me),
        )
    elif kind == "expert":
        replica.local_write(me, lambda d: documents.write_expert(d, expert=f"e{value % 4}", owned=value % 2 == 0))
    elif replica.peer_id in replica.admins:
        replica.local_write("config", lambda d: documents.write_config(d, {f"k{value % 3}": value, "by": me}))


def receive_honest(dst: Replica, env, src: Replica | None = None) -> None:
    """Deliver one envelope between honest replicas: the only possible rejection is a replay."""
    try:
        dst.receive(env, from_peer=src.peer_id if src else None)
    except RejectedUpdate as exc:
        reason = exc.reason
    else:
        reason = "replay"
    assert reason == "replay"


def deliver(src: Replica, dst: Replica, data) -> None:
    envelopes = src.missing_for(dst.state_vector())
    envelopes += data.draw(st.lists(st.sampled_from(src.retained()), max_size=3)) if src.retained() else []
    order = data.draw(st.permutations(envelopes))
    keep = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    for env, kept in zip(order, keep, strict=True):
        if not kept:
            continue
        receive_honest(dst, env, src)


def heal(replicas: list[Replica]) -> None:
    for _ in range(len(replicas)):
        for src in replicas:
            for dst in replicas:
                if src is not dst:
                    for env in src.missing_for(dst.state_vector()):
                        receive_honest(dst, env)


operation = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 4), st.sampled_from(WRITE_KINDS), st.integers(0, 50)),
    st.tuples(st.just("sync"), st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("partition"), st.sets(st.integers(0, 4))),
    st.tuples(st.just("heal")),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 5), ops=st.lists(operation, max_size=40), data=st.data())
def test_replicas_converge(n, ops, data):
    replicas = make_replicas(n, admin_count=2, limits=ReplicaLimits(snapshot_every=4), seeded=True)
    side: set[int] = set()
    for op in ops:
        if op[0] == "write":
            apply_write(replicas[op[1] % n], op[2], op[3])
        elif op[0] == "sync":
            src, dst = op[1] % n, op[2] % n
            if src != dst and (src in side) == (dst in side):
                deliver(replicas[src], replicas[dst], data)
        elif op[0] == "partition":
            side = {i % n for i in op[1]}
        else:
            side = set()
    own_views = {r.peer_id: r.snapshot() for r in replicas}
    heal(replicas)
    vectors = [r.state_vector() for r in replicas]
    assert all(v == vectors[0] for v in vectors)
    snapshots = [r.snapshot() for r in replicas]
    assert all(s == snapshots[0] for s in snapshots)
    for peer, view in own_views.items():  # nothing a writer wrote to its own doc was lost
        assert snapshots[0]["members"].get(peer) == view["members"].get(peer)
        assert snapshots[0]["progress"].get(peer) == view["progress"].get(peer)
    for r in replicas:
        assert set(r.counters()["updates_rejected"]) <= {"replay"}
