"""The replicated run state of a virtual swarm: real replicas, real sessions, counted bytes.

Every member writes its own document through its own ``Replica`` (membership record, role,
lease renewals, round progress), as ``ReplicatedState`` does: ``set_progress`` once per round,
each write renewing the lease with it, a renewal on its own when none was written for
``LeasePolicy.interval_for`` the members that have not left (counted every 10 s), ``leave`` on a
clean stop; a killed member just stops. Each
write reaches the reference replica (the swarm's union, see the package docstring). Each
observer, at every tick, runs one real session with the reference: the envelopes it lacks are
batched (``sync.batches``) and packed, and received through ``Replica.receive``.

Traffic per peer. In the daemon a member runs the sessions its ``sync_plan.SyncPlan`` plans
each ``sync_interval`` (a push of its news to ``fanout`` random peers, a full repair session now
and then, full sessions until its first one completed) and answers those of its peers. An
observer keeps its own ``SyncPlan`` and ``News`` (the streams whose ``have`` rose at it, from
its real session and its own writes) and plans among ``degree`` peers (those whose proof is
older than half a lease refreshed, as ``ProvenPeers.aging`` asks): each planned session
moves its hello (version 3, partial over the news or full, packed) out and the answer in: to a
full hello the peer's whole vector (about the same size), to a push the rows where the peer
differs. Which those are is modelled, not run: every member hears of a change once, from the
first push that reaches it, and answers that one with the row, so a change's row is in one
answer per member; an observer's answer lists the rows it pushes for the first time, and
nothing to a push of rows it pushed before. As every member plans as many sessions, it answers
as many, of the same sizes. The envelopes a member lacks reach it once (the first
session that has them); each member forwards on average as much as it receives, so the
envelopes of the observer's real session are counted both ways. ``traffic`` is the total both
ways; per direction is half of it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
from libp2p.crypto.ed25519 import create_new_key_pair
from pycrdt import Doc, Map

from lattica.crdt import documents, sync
from lattica.crdt.config import ReplicaLimits, StateConfig
from lattica.crdt.envelope import Envelope, RejectedUpdate
from lattica.crdt.liveness import LeasePolicy, live_members, present
from lattica.crdt.replica import Replica
from lattica.crdt.streams import StreamKey
from lattica.crdt.sync_plan import News, SyncPlan, SyncPolicy

RUN = "sim-run"


def packed_size(message: object) -> int:
    return len(msgpack.packb(message, use_bin_type=True))


@dataclass
class Member:
    replica: Replica
    index: int
    heartbeat: int = 0
    next_beat_s: float = 0.0
    alive: bool = True

    @property
    def peer_id(self) -> str:
        return self.replica.peer_id


@dataclass
class Traffic:
    hello_bytes: int = 0
    envelope_bytes: int = 0
    sessions: int = 0
    full_sessions: int = 0

    def total(self) -> int:
        return self.hello_bytes + self.envelope_bytes


@dataclass
class StateSwarm:
    """``lease``: the state service's lease policy; ``degree``: connected peers per member."""

    seed: int = 0
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    limits: ReplicaLimits = field(default_factory=ReplicaLimits)
    degree: int = 64
    observers: int = 4
    state_config: StateConfig = field(default_factory=StateConfig)
    members: dict[str, Member] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)
    now_s: float = 0.0
    _next_index: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.reference = self._new_replica()
        self.watchers: list[Replica] = []
        self.admin: Member | None = None
        self.plan_policy: SyncPolicy = self.state_config.plan
        self._plans: dict[str, tuple[SyncPlan, News, dict[StreamKey, int]]] = {}  # watcher -> plan, news, haves
        self._last_session: dict[tuple[str, str], float] = {}  # (watcher, peer) -> its last session
        self._pushed: dict[str, dict[StreamKey, int]] = {}  # watcher -> the have it last pushed of each stream
        self._peer_names = [f"peer-{i}" for i in range(self.degree)]
        self._interval = self.lease.heartbeat_interval

    # -- membership ----------------------------------------------------------------------------

    def _new_replica(self) -> Replica:
        self._next_index += 1
        seed = self._next_index.to_bytes(8, "big") + self.seed.to_bytes(8, "big") + bytes(16)
        return Replica(run_id=RUN, key_pair=create_new_key_pair(seed), admins=(), limits=self.limits)

    def join(self) -> Member:
        replica = self._new_replica()
        if self.admin is None:
            replica.adopt_admin(replica.peer_id)
            self.reference.adopt_admin(replica.peer_id)
        member = Member(replica, self._next_index, next_beat_s=self.now_s)
        self.members[member.peer_id] = member
        if self.admin is None:
            self.admin = member
            for watcher in self.watchers:
                watcher.adopt_admin(member.peer_id)
            self._publish(replica.local_write(documents.CONFIG_DOC, lambda d: documents.write_config(
                d, {"strategy": "diloco", "averaging": "gossip", "inner_steps": 50})))
        self._beat(member, lambda d: documents.write_member(
            d, {"addrs": [f"/ip4/10.{member.index // 250}.{member.index % 250}.1/tcp/4001"],
                "device": "cpu", "role": "trainer", "reachability": "public"}))
        return member

    def add_observers(self) -> None:
        """Turn the first ``observers`` members into full replicas (they stay to the end)."""
        for member in list(self.members.values())[: self.observers]:
            self.watchers.append(member.replica)
            if self.admin is not None:
                member.replica.adopt_admin(self.admin.peer_id)

    def leave(self, member: Member) -> None:
        member.heartbeat += 1
        beat = member.heartbeat
        self._write(member, lambda d: documents.write_lease(d, lease_expires_ms=0, heartbeat=beat, left=True))
        member.alive = False

    def kill(self, member: Member) -> None:
        member.alive = False

    def churnable(self) -> list[Member]:
        keep = {w.peer_id for w in self.watchers} | ({self.admin.peer_id} if self.admin else set())
        return [m for m in self.members.values() if m.alive and m.peer_id not in keep]

    def alive(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    # -- writes ----------------------------------------------------------------------------------

    def _write(self, member: Member, mutate: Callable[[Doc[Map[object]]], None]) -> None:
        self._publish(member.replica.local_write(member.peer_id, mutate))

    def _publish(self, envelopes: list[Envelope]) -> None:
        for env in envelopes:
            with contextlib.suppress(RejectedUpdate):
                self.reference.receive(env)

    def _beat(self, member: Member, mutate: Callable[[Doc[Map[object]]], None] = lambda d: None) -> None:
        """A write of ``member``'s record with its lease renewed in it, as ``ReplicatedState`` writes
        every write of its own record; the next renewal on its own is due an interval later."""
        member.heartbeat += 1
        expires = self.lease.lease_expiry_ms(self.now_ms, self._interval)
        beat = member.heartbeat

        def renewed(doc: Doc[Map[object]]) -> None:
            mutate(doc)
            documents.write_lease(doc, lease_expires_ms=expires, heartbeat=beat)

        self._write(member, renewed)
        member.next_beat_s = self.now_s + self._interval

    def heartbeat_interval(self) -> float:
        return self._interval

    def progress(self, round_: int) -> None:
        for member in self.alive():
            self._beat(member, lambda d: documents.write_progress(d, round=round_, weights_hash=f"{round_:064x}"))

    # -- time ------------------------------------------------------------------------------------

    @property
    def now_ms(self) -> int:
        return int(self.now_s * 1000)

    def tick(self, dt: float) -> None:
        """Advance ``dt`` seconds: due heartbeats, then every observer's session of this tick."""
        self.now_s += dt
        if int(self.now_s) % 10 == 0:
            self._interval = self.lease.interval_for(present(self.reference.snapshot()["members"]))
        for member in self.alive():
            if member.next_beat_s <= self.now_s:
                self._beat(member)
        self.reference.tick(self.now_s)
        for watcher in self.watchers:
            self._session(watcher)
        if int(self.now_s) % 30 == 0:  # the service looks at every heartbeat: a clean leave is seen <= 30 s later here
            for replica in (self.reference, *self.watchers):
                self.forget_departed(replica)

    def forget_departed(self, replica: Replica) -> None:
        after_ms = int(self.state_config.forget_departed_after_s * 1000)
        replica.forget_departed(replica.snapshot()["members"], now_ms=self.now_ms, after_ms=after_ms)

    def _session(self, replica: Replica) -> None:
        """One real session of ``replica`` with the reference (the envelopes it lacks), and the
        hellos of the sessions its plan runs this tick (see the module docstring)."""
        plan, news, haves = self._plans.setdefault(
            replica.peer_id, (SyncPlan(self.plan_policy, rng=random.Random(self.rng.random())),
                              News(self.plan_policy.news_window_s), {}))
        held = replica.state_vector()
        missing = self.reference.missing_for(held)
        batches = sync.batches(missing, holders=sync.holders(held))  # type: ignore[arg-type]
        envelope_bytes = sum(packed_size(batch) for batch in batches) + packed_size({"t": "end"})
        for env in missing:
            with contextlib.suppress(RejectedUpdate):
                replica.receive(env, from_peer=self.reference.peer_id)
        self.traffic.envelope_bytes += 2 * envelope_bytes
        vector = replica.state_vector()
        rises = {(str(r[0]), str(r[1])) for r in vector if int(r[2]) > haves.get((str(r[0]), str(r[1])), 0)}
        haves.clear()
        haves.update({(str(r[0]), str(r[1])): int(r[2]) for r in vector})
        news.note(rises, self.now_s)
        recent = news.keys(self.now_s)
        proof_s = self.lease.scaled_lease(self._interval)  # ProvenPeers' lease
        refresh = [p for p in self._peer_names
                   if self._last_session.get((replica.peer_id, p), -proof_s) < self.now_s - proof_s / 2]
        pushed = self._pushed.setdefault(replica.peer_id, {})
        for session in plan.due(self._peer_names, self.now_s, news=bool(recent), holding=False, refresh=refresh):
            self._last_session[(replica.peer_id, session.peer)] = self.now_s
            rows = vector if session.full else sync.rows_among(vector, recent) if session.news else []
            hello = packed_size(sync.hello(RUN, rows, partial=not session.full))
            answer = hello if session.full else packed_size(sync.hello(RUN, self._unheard(rows, pushed), partial=True))
            self.traffic.hello_bytes += 2 * (hello + answer)  # ours and the answer; as many answered by us
            self.traffic.sessions += 2
            self.traffic.full_sessions += 2 * session.full
            plan.completed(session)

    @staticmethod
    def _unheard(rows: list[list[str | int]], pushed: dict[StreamKey, int]) -> list[list[str | int]]:
        """The rows of a push its answer lists (see the module docstring): those this observer
        pushes for the first time."""
        unheard = [row for row in rows if pushed.get((str(row[0]), str(row[1])), 0) < int(row[2])]
        pushed.update({(str(row[0]), str(row[1])): int(row[2]) for row in unheard})
        return unheard

    # -- measurements ------------------------------------------------------------------------------

    def live(self, replica: Replica | None = None) -> list[str]:
        replica = replica or self.reference
        members = replica.snapshot()["members"]
        skew = int(self.lease.clock_skew * 1000)
        return live_members(members, now_ms=self.now_ms, clock_skew_ms=skew, max_ahead_ms=self.lease.max_ahead_ms)

    def state_bytes(self, replica: Replica) -> int:
        """What the replica holds, as its state log stores it (each envelope packed)."""
        return sum(packed_size(env.to_wire()) for env in replica.retained())

    def join_state(self, bootstrap: Member, links: object) -> tuple[float, int]:
        """A newcomer's session with ``bootstrap`` (a full replica): seconds until it holds the
        run's state (two hellos, then the envelopes), and the bytes it received."""
        newcomer = self._new_replica()
        missing = bootstrap.replica.missing_for([])
        batches = sync.batches(missing)
        answer = sync.hello(RUN, bootstrap.replica.state_vector())
        received = sum(packed_size(b) for b in batches) + packed_size(answer)
        for env in missing:
            with contextlib.suppress(RejectedUpdate):
                newcomer.receive(env)
        a, b = newcomer.peer_id, bootstrap.peer_id
        seconds = links.latency_s(a, b) + links.transfer_s(b, a, received)  # type: ignore[attr-defined]
        return seconds, received
