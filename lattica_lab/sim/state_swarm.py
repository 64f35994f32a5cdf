"""The replicated run state of a virtual swarm: real replicas, real sessions, counted bytes.

Every member writes its own document through its own ``Replica`` (membership record, role,
lease renewals, round progress), as ``ReplicatedState`` does: ``heartbeat`` every
``LeasePolicy.heartbeat_interval``, ``set_progress`` once per round, ``leave`` on a clean
stop; a killed member just stops. Each write reaches the reference replica (the swarm's union,
see the package docstring). Each observer, at every tick, runs one real session with the
reference: both hellos are packed with msgpack (``sync.hello``), the envelopes it lacks are
batched (``sync.batches``) and packed, and received through ``Replica.receive``.

Traffic per peer. In the daemon a member runs a session with each connected peer whenever its
state changed (and at least every ``sync_interval``), and answers theirs: per tick and
connected peer two sessions, each with one hello each way. The envelopes a member lacks reach
it once (the first session that has them); each member forwards on average as much as it
receives. So per tick an observer moves ``2 x degree x (hello sent + hello received)`` plus the
envelopes of its real session, counted both ways; ``bytes_per_round`` is half of that total
(per direction), per round of ``round_s``.
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
from lattica.crdt.liveness import LeasePolicy, live_members
from lattica.crdt.replica import Replica

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
        self._write(member, lambda d: documents.write_member(
            d, {"addrs": [f"/ip4/10.{member.index // 250}.{member.index % 250}.1/tcp/4001"],
                "device": "cpu", "role": "trainer", "reachability": "public"}))
        self._beat(member)
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

    def _beat(self, member: Member) -> None:
        member.heartbeat += 1
        expires = self.lease.lease_expiry_ms(self.now_ms)
        beat = member.heartbeat
        self._write(member, lambda d: documents.write_lease(d, lease_expires_ms=expires, heartbeat=beat))
        member.next_beat_s = self.now_s + self.heartbeat_interval()

    def heartbeat_interval(self) -> float:
        return self.lease.heartbeat_interval

    def progress(self, round_: int) -> None:
        for member in self.alive():
            self._write(member, lambda d: documents.write_progress(d, round=round_, weights_hash=f"{round_:064x}"))

    # -- time ------------------------------------------------------------------------------------

    @property
    def now_ms(self) -> int:
        return int(self.now_s * 1000)

    def tick(self, dt: float) -> None:
        """Advance ``dt`` seconds: due heartbeats, then every observer's session of this tick."""
        self.now_s += dt
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
        """One real session of ``replica`` with the reference, and the hellos of its other ones."""
        mine, theirs = replica.state_vector(), self.reference.state_vector()
        hellos = packed_size(sync.hello(RUN, mine)) + packed_size(sync.hello(RUN, theirs))
        missing = self.reference.missing_for(mine)
        envelope_bytes = sum(packed_size(batch) for batch in sync.batches(missing)) + packed_size({"t": "end"})
        for env in missing:
            with contextlib.suppress(RejectedUpdate):
                replica.receive(env, from_peer=self.reference.peer_id)
        sessions = 2 * self.degree if missing or replica.state_vector() != mine else 0
        self.traffic.hello_bytes += hellos * max(sessions, 1)
        self.traffic.envelope_bytes += 2 * envelope_bytes
        self.traffic.sessions += sessions

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
        received = sum(packed_size(b) for b in batches) + packed_size(sync.hello(RUN, bootstrap.replica.state_vector()))
        for env in missing:
            with contextlib.suppress(RejectedUpdate):
                newcomer.receive(env)
        a, b = newcomer.peer_id, bootstrap.peer_id
        seconds = links.latency_s(a, b) + links.transfer_s(b, a, received)  # type: ignore[attr-defined]
        return seconds, received
