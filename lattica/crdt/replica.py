"""The replica core: per-writer documents, signed streams, state vectors — sans-IO.

Theory of operation
-------------------
A *stream* is the sequence of envelopes one writer produced for one document: ``(peer, peer)``
for a writer's own document, ``("config", admin)`` for each admin's changes to the run config.
For every stream the replica keeps ``have`` (the highest contiguous seq applied) and the
envelopes needed to bring anyone else up to ``have``: either everything from seq 1, or a
``full`` snapshot followed by the increments after it. Invariants:

- an envelope is applied only after its signature, writer key and write permission checked;
- the run config (``CONFIG_DOC``) is written by admins only. Who they are is each node's own
  decision: a fixed set (``admins``), or — with ``admin_relays`` — also whoever's run config
  reaches it through a peer it trusts for that (a peer it joined through, an admin, or itself
  replaying its own log, which holds only what it accepted before): that writer becomes an
  admin for it. Authority thus flows from the run's founder along the joins and survives a
  restart, whatever the command line of the restart says;
- a stream's envelopes are applied in seq order; early arrivals wait in a small bounded
  buffer for at most ``pending_ttl`` (``tick(now)`` expires them) or are dropped and fetched
  again by anti-entropy;
- a second copy of an applied seq is a replay: counted, never applied twice;
- a writer's table is bounded (``max_streams``): when it is full, the stream of the oldest
  writer the owner does not trust (``trusted``: seen on a live connection, an admin, ourselves)
  is evicted, and that writer's envelopes are refused until it becomes trusted, so throwaway
  keys cannot lock real members out, nor make anti-entropy fetch them again and again.

Equivocation
------------
Two validly signed envelopes of one writer under the same ``(doc, seq)`` with different content
are a proof that the writer equivocated (sent different histories to different peers, which
would otherwise never converge: each replica keeps the first it saw). Whoever sees the pair
*bans* the writer: every document and stream of it is dropped, its later envelopes are refused
(``banned``), and the pair is kept as *evidence*. ``missing_for`` sends the evidence to every
peer whose state vector still lists the writer, which then sees the pair and bans it too — so
every honest replica ends without the writer's content, whichever history it saw first. The
evidence is part of ``retained()`` (and so of the durable log): a restart bans again.

A fork is *healed* by a ``full`` snapshot of the writer, signed under a seq above both envelopes
of the pair, whose content already holds both (applying either to it changes nothing): every
replica that takes it ends on the same document, whichever fork it held. A replica that holds
such a snapshot does not ban for an older pair (``superseded``), and one that banned the writer
takes the snapshot and lifts the ban. This is how a writer repairs the fork below.

A writer's own history
----------------------
A node restarted from an older copy of its data dir (a backup) holds its streams up to some seq
k while the swarm holds its envelopes up to n > k from the life after the copy; writing k + 1
again would sign a second history. So the owner ``hold_own_streams()`` at start: until the
first completed sync session (``settle()``), its own streams are neither listed in
``state_vector()`` (a peer then sends every envelope of ours it holds) nor offered by
``missing_for()`` — local writes are kept and persisted, not published. An envelope of ours that
comes back and is not a copy of what we hold — while holding, or later (a peer we met first did
not know our newer entries) — is *absorbed*: its content is merged into our document, it is not
kept in the stream, we never ban ourselves for it, and we hold again. ``settle()`` then
supersedes: our document's entries are set back to what this life wrote (the absorbed ones
describe a past life: rounds and checkpoints we no longer hold), and one ``full`` snapshot is
signed under the seq after the highest one seen. It holds both histories, so it heals the fork
at any replica that saw our other history, and our next writes follow it.

Compaction
----------
Yjs keeps every overwritten entry of a document as a tombstone, so a member's document would
grow by tens of bytes with every lease renewal, for ever. A writer's own stream is therefore
compacted: once the increments since its last snapshot hold more bytes than it (or after
``snapshot_every`` envelopes), the writer rebuilds its document from its current content
(``documents.compacted``) and signs that as the next ``full`` snapshot. A replica that applies a
writer's snapshot *replaces* its copy of that document with it (the shared run config, written
by several admins, is merged instead), so every replica holds about twice a member's current
document at most, whatever its history; a restart replays the snapshot and the increments after
it. Departed members are forgotten: ``forget_departed`` drops the documents of writers whose lease
ended long ago (the state service: ``StateConfig.forget_departed_after_s``), so the state holds
the members of the run, not of its whole history.

A fork entirely below a writer's snapshot that a replica holds is superseded, not a reason
to ban: every replica ends on that snapshot.

Anti-entropy is two pure functions: ``state_vector()`` (stream -> have) and
``missing_for(vector)`` (the envelopes a peer with that vector lacks). Yjs updates commute
and are idempotent, so replicas that hold the same envelopes hold identical documents,
whatever the delivery order.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from pycrdt import Doc, Map

from lattica.crdt.documents import (
    CONFIG_DOC,
    MemberRecord,
    Snapshot,
    build_snapshot,
    compacted,
    reassert,
)
from lattica.crdt.envelope import (
    Envelope,
    RejectedUpdate,
    envelope_from_wire,
    sign_envelope,
    verify_envelope,
)
from lattica.errors import LocalProtocolError


@dataclass(frozen=True, kw_only=True)
class ReplicaLimits:
    max_update_bytes: int = 64 * 1024
    max_snapshot_bytes: int = 1024 * 1024
    max_stream_bytes: int = 4 * 1024 * 1024
    max_streams: int = 4096
    max_pending_per_stream: int = 64
    max_pending_total: int = 1024
    pending_ttl: float = 30.0  # seconds an early arrival waits for its predecessors
    max_banned: int = 1024  # equivocating writers remembered (each needs two signed envelopes)
    snapshot_every: int = 128

    def __post_init__(self) -> None:
        for name in ("max_update_bytes", "max_snapshot_bytes", "max_stream_bytes", "max_streams"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_snapshot_bytes < self.max_update_bytes:
            raise ValueError("max_snapshot_bytes must be >= max_update_bytes")
        if self.max_stream_bytes < self.max_snapshot_bytes:
            raise ValueError("max_stream_bytes must be >= max_snapshot_bytes")
        if self.max_pending_per_stream < 0 or self.max_pending_total < 0:
            raise ValueError("pending buffer sizes must be >= 0")
        if not self.pending_ttl > 0:
            raise ValueError("pending_ttl must be positive")
        if self.max_banned < 1:
            raise ValueError("max_banned must be >= 1")
        if self.snapshot_every < 2:
            raise ValueError("snapshot_every must be >= 2")


@dataclass
class _Stream:
    have: int = 0
    retained: list[Envelope] = field(default_factory=list)
    pending: dict[int, tuple[Envelope, float]] = field(default_factory=dict)  # seq -> (env, arrival)

    def retained_bytes(self) -> int:
        return sum(len(env.update) for env in self.retained)

    def find(self, seq: int) -> Envelope | None:
        for env in self.retained:
            if env.seq == seq:
                return env
        return None


StreamKey = tuple[str, str]
_SeqKey = tuple[str, str, int]  # doc, writer, seq
_MAX_LOOSE = 256  # envelopes seen but not held, kept to spot an equivocation among them
_MAX_EVICTED = 16_384  # evicted writers remembered (refused until trusted)
_MAX_OWN_SIGNED = 65_536  # our own envelopes recognized after compaction (older ones: superseded again)


class Replica:
    """One node's copy of the run state; feed it envelopes, ask it what peers miss.

    ``trusted(writer)`` says whether the owner has seen ``writer`` prove itself (a live,
    authenticated connection); only untrusted writers' streams are evicted when the table is full.
    ``admin_relays``: None, only ``admins`` write the run config; else also the writers whose
    run config these peers, an admin or this node itself relay (see the module docstring).
    """

    def __init__(
        self,
        *,
        run_id: str,
        key_pair: KeyPair,
        admins: Iterable[str],
        limits: ReplicaLimits | None = None,
        trusted: Callable[[str], bool] | None = None,
        admin_relays: Iterable[str] | None = None,
    ) -> None:
        self.run_id = run_id
        self.key_pair = key_pair
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        self.admins = frozenset(admins)
        self._admin_relays = None if admin_relays is None else frozenset(admin_relays)
        self.limits = limits or ReplicaLimits()
        self.trusted = trusted or (lambda writer: False)
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self._docs: dict[str, Doc[Map[object]]] = {}
        self._streams: dict[StreamKey, _Stream] = {}
        self._pending_total = 0  # early arrivals buffered over all streams
        self._now = 0.0  # the owner's clock, as of the last ``tick``
        self._evicted: OrderedDict[str, None] = OrderedDict()  # writers refused until trusted
        self._departed: OrderedDict[str, int] = OrderedDict()  # forgotten writers -> the seq we held
        self._banned: OrderedDict[str, tuple[Envelope, Envelope]] = OrderedDict()  # -> evidence
        self._new_evidence: list[Envelope] = []  # evidence not yet handed to ``take_new_evidence``
        self._loose: OrderedDict[_SeqKey, Envelope] = OrderedDict()  # seen, not held
        self._holding = False  # our own streams are not published (see "A writer's own history")
        self._own_seen: dict[StreamKey, int] = {}  # our streams -> highest seq absorbed
        self._this_life: dict[str, Doc[Map[object]]] = {}  # our document as this life wrote it
        self._own_signed: OrderedDict[str, None] = OrderedDict()  # digests of our envelopes held (``_keep``)
        self.superseded = 0  # snapshots signed to supersede another life's envelopes

    # -- local writes --------------------------------------------------------------------------

    def local_write(self, doc_name: str, mutate: Callable[[Doc[Map[object]]], None]) -> list[Envelope]:
        """Apply ``mutate`` to one of our documents; return the envelopes to persist and send."""
        if doc_name == CONFIG_DOC and self.peer_id not in self.admins:
            raise LocalProtocolError("only admin keys may change the run config")
        if doc_name not in (CONFIG_DOC, self.peer_id):
            raise LocalProtocolError(f"cannot write another writer's document {doc_name!r}")
        doc = self._doc(doc_name)
        before = doc.get_state()
        mutate(doc)
        if doc_name in self._this_life:
            mutate(self._this_life[doc_name])
        update = doc.get_update(before)
        if update == b"\x00\x00":  # nothing changed
            return []
        stream = self._stream((doc_name, self.peer_id))
        envelopes = [self._sign_and_keep(stream, doc_name, update, full=False)]
        if self._snapshot_due(stream):
            if doc_name != CONFIG_DOC:  # ours alone: rebuilt without the history of overwritten entries
                doc = self._docs[doc_name] = compacted(doc)
            envelopes.append(self._sign_and_keep(stream, doc_name, doc.get_update(), full=True))
        return envelopes

    def _snapshot_due(self, stream: _Stream) -> bool:
        """A snapshot after ``snapshot_every`` envelopes, or once the increments since the last
        snapshot hold more bytes than it (so a stream holds about twice its document at most)."""
        if len(stream.retained) >= self.limits.snapshot_every:
            return True
        head, increments = stream.retained[0], stream.retained[1:]
        return head.full and sum(env.encoded_size() for env in increments) > head.encoded_size()

    def _sign_and_keep(
        self, stream: _Stream, doc_name: str, update: bytes, *, full: bool, seq: int | None = None
    ) -> Envelope:
        cap = self.limits.max_snapshot_bytes if full else self.limits.max_update_bytes
        if len(update) > cap:
            raise LocalProtocolError(f"update of {len(update)} bytes exceeds the {cap}-byte limit")
        env = sign_envelope(
            self.key_pair, run=self.run_id, doc=doc_name, seq=seq or stream.have + 1, full=full, update=update
        )
        self._keep(stream, env)
        self.accepted += 1
        return env

    # -- remote envelopes ----------------------------------------------------------------------

    def receive_wire(self, obj: object, *, from_peer: str | None = None) -> list[Envelope]:
        """Validate and apply an untrusted wire envelope; return those newly applied."""
        try:
            cap = max(self.limits.max_update_bytes, self.limits.max_snapshot_bytes)
            env = envelope_from_wire(obj, max_update_bytes=cap, peer_id=from_peer)
        except RejectedUpdate as exc:
            self.rejected[exc.reason] += 1
            raise
        return self.receive(env, from_peer=from_peer)

    def receive(self, env: Envelope, *, from_peer: str | None = None) -> list[Envelope]:
        """Validate and apply an envelope (and any buffered successors); return those applied.

        Raises ``RejectedUpdate`` (counted by reason) for anything invalid or replayed.
        """
        try:
            return self._receive(env, from_peer)
        except RejectedUpdate as exc:
            self.rejected[exc.reason] += 1
            raise

    def _receive(self, env: Envelope, from_peer: str | None) -> list[Envelope]:
        cap = self.limits.max_snapshot_bytes if env.full else self.limits.max_update_bytes
        if len(env.update) > cap:
            raise RejectedUpdate("oversized", f"{len(env.update)} bytes > {cap}", peer_id=from_peer)
        verify_envelope(env, run=self.run_id, peer_id=from_peer)
        relayed_admin = self._check_permission(env, from_peer)
        if env.writer == self.peer_id:
            if relayed_admin:  # our own run config, replayed from our state log
                self.adopt_admin(env.writer)
            return self._receive_own(env, from_peer)
        if env.writer in self._banned:
            if not self._heals(env, self._banned[env.writer]):
                raise RejectedUpdate("banned", f"{env.writer} equivocated", peer_id=from_peer)
            del self._banned[env.writer]
        self._check_equivocation(env, from_peer)
        if relayed_admin:
            self.adopt_admin(env.writer)
        stream = self._admit(env, from_peer)
        if env.seq <= stream.have:
            return self._replay(stream, env, from_peer)
        if env.seq > stream.have + 1 and not env.full:
            self._buffer(stream, env)
            return []
        applied = [self._apply(stream, env, from_peer)]
        while (nxt := stream.pending.get(stream.have + 1)) is not None:
            applied.append(self._apply(stream, nxt[0], from_peer))
        before = len(stream.pending)
        stream.pending = {s: e for s, e in stream.pending.items() if s > stream.have}
        self._pending_total -= before - len(stream.pending)
        return applied

    def _admit(self, env: Envelope, from_peer: str | None) -> _Stream:
        """The envelope's stream, making room for a new writer by evicting an untrusted one."""
        stream = self._streams.get(env.stream)
        if stream is not None:
            return stream
        if env.writer in self._departed:
            if env.seq <= self._departed[env.writer]:
                raise RejectedUpdate("departed", f"{env.writer} left the run", peer_id=from_peer)
            del self._departed[env.writer]
        if env.writer in self._evicted:
            if not self._protected(env.writer):
                raise RejectedUpdate("evicted", f"{env.writer} has not proven itself", peer_id=from_peer)
            del self._evicted[env.writer]
        if len(self._streams) >= self.limits.max_streams and not self._evict_one():
            raise RejectedUpdate("too_many_writers", "stream table full", peer_id=from_peer)
        return self._stream(env.stream)

    def _protected(self, writer: str) -> bool:
        return writer == self.peer_id or writer in self.admins or self.trusted(writer)

    def _evict_one(self) -> bool:
        """Drop the streams of the oldest writer we do not trust; False when every writer is."""
        for _, writer in self._streams:  # insertion order: the oldest first
            if not self._protected(writer):
                self._forget_writer(writer)
                self._evicted[writer] = None
                while len(self._evicted) > _MAX_EVICTED:
                    self._evicted.popitem(last=False)
                return True
        return False

    def _buffer(self, stream: _Stream, env: Envelope) -> None:
        if env.seq in stream.pending:  # the same envelope again (a different one is caught above)
            return
        if (
            len(stream.pending) < self.limits.max_pending_per_stream
            and self._pending_total < self.limits.max_pending_total
        ):
            stream.pending[env.seq] = (env, self._now)
            self._pending_total += 1
        else:
            self._remember_loose(env)

    def adopt_admin(self, writer: str) -> None:
        """``writer`` may write the run config from now on."""
        self.admins = self.admins | {writer}

    def _check_permission(self, env: Envelope, from_peer: str | None) -> bool:
        """Raise unless ``env.writer`` may write ``env.doc``; True when it may because a peer
        we trust for it relayed its run config (it becomes an admin)."""
        if env.doc == env.writer:
            return False
        if env.doc == CONFIG_DOC and env.writer in self.admins:
            return False
        if env.doc == CONFIG_DOC and self._relays_admins(from_peer):
            return True
        raise RejectedUpdate(
            "unauthorized", f"{env.writer} may not write document {env.doc!r}", peer_id=from_peer
        )

    def _relays_admins(self, peer: str | None) -> bool:
        if self._admin_relays is None or peer is None:
            return False
        return peer == self.peer_id or peer in self._admin_relays or peer in self.admins

    def _replay(self, stream: _Stream, env: Envelope, from_peer: str | None) -> list[Envelope]:
        if stream.find(env.seq) is None:
            self._remember_loose(env)  # compacted away: compare it with the next copy instead
        raise RejectedUpdate("replay", f"seq {env.seq} already applied", peer_id=from_peer)

    def _apply(self, stream: _Stream, env: Envelope, from_peer: str | None) -> Envelope:
        if not env.full and stream.retained_bytes() + len(env.update) > self.limits.max_stream_bytes:
            raise RejectedUpdate("oversized", "stream exceeds its byte budget", peer_id=from_peer)
        try:
            if env.full and env.doc == env.writer:  # a writer's snapshot stands in for its whole document
                self._docs[env.doc] = _doc_from(env.update)
            else:
                self._doc(env.doc).apply_update(env.update)
        except Exception as exc:  # noqa: BLE001 - pycrdt (Rust) raises its own kinds for an undecodable update from the wire
            raise RejectedUpdate("bad_update", f"undecodable update: {exc}", peer_id=from_peer) from None
        self._keep(stream, env)
        self.accepted += 1
        return env

    # -- our own history -----------------------------------------------------------------------

    def hold_own_streams(self) -> None:
        """Publish none of our own envelopes until ``settle()`` (see "A writer's own history")."""
        self._holding = True

    @property
    def holding(self) -> bool:
        return self._holding

    def settle(self) -> list[Envelope]:
        """Publish our own streams again (the owner calls this after a completed sync session);
        supersede the envelopes of another life absorbed meanwhile. Returns the snapshots to
        persist and send."""
        snapshots = []
        for key, seen in sorted(self._own_seen.items()):
            this_life = self._this_life.pop(key[0], None)
            if this_life is not None:
                reassert(self._doc(key[0]), this_life)
            stream = self._stream(key)
            update = self._doc(key[0]).get_update()
            snapshots.append(self._sign_and_keep(stream, key[0], update, full=True, seq=max(stream.have, seen) + 1))
            del self._own_seen[key]
        self._holding = False
        self.superseded += len(snapshots)
        return snapshots

    def _receive_own(self, env: Envelope, from_peer: str | None) -> list[Envelope]:
        """One of our own envelopes: a copy of ours is a replay; the next one of our stream is
        taken while we publish (a replay of our log at start); anything else is another life's."""
        stream = self._stream(env.stream)
        if stream.find(env.seq) == env or _digest(env) in self._own_signed:  # compacted away, still ours
            return self._replay(stream, env, from_peer)
        follows = env.seq == stream.have + 1 or (env.full and env.seq > stream.have)
        if follows and not self._holding:
            return [self._apply(stream, env, from_peer)]
        return self._absorb(stream, env, from_peer)

    def _absorb(self, stream: _Stream, env: Envelope, from_peer: str | None) -> list[Envelope]:
        """Merge another life's envelope of ours into our document, to be superseded."""
        doc = self._doc(env.doc)
        before = doc.get_update()
        try:
            doc.apply_update(env.update)
        except Exception as exc:  # noqa: BLE001 - pycrdt (Rust) raises its own kinds for an undecodable update
            raise RejectedUpdate("bad_update", f"undecodable update: {exc}", peer_id=from_peer) from None
        changed = doc.get_update() != before
        if not changed and env.seq <= stream.have:
            raise RejectedUpdate("replay", f"seq {env.seq} already held", peer_id=from_peer)
        if changed and env.doc != CONFIG_DOC and env.doc not in self._this_life:
            self._this_life[env.doc] = _doc_from(before)
        self._own_seen[env.stream] = max(self._own_seen.get(env.stream, 0), env.seq)
        self._holding = True
        return []

    # -- equivocation --------------------------------------------------------------------------

    def _check_equivocation(self, env: Envelope, from_peer: str | None) -> None:
        """Ban ``env.writer`` if another signed envelope of it holds the same (doc, seq) and no
        snapshot of it that we hold has healed that fork."""
        other = self._copy_of(env)
        if other is None or other == env:
            return
        if self._superseded(env, other):
            raise RejectedUpdate("superseded", f"seq {env.seq} of {env.writer} is healed by a snapshot", peer_id=from_peer)
        self._ban(env.writer, (other, env))
        raise RejectedUpdate(
            "equivocation", f"{env.writer} signed two different updates for seq {env.seq}", peer_id=from_peer
        )

    def _superseded(self, env: Envelope, other: Envelope) -> bool:
        stream = self._streams.get(env.stream)
        snapshot = stream.retained[0] if stream is not None and stream.retained else None
        if snapshot is None:
            return False
        if snapshot.full and snapshot.doc == snapshot.writer and all(e.seq < snapshot.seq for e in (env, other)):
            return True  # every replica replaces the writer's document with that snapshot: both sides are gone
        return self._heals(snapshot, (env, other))

    @staticmethod
    def _heals(snapshot: Envelope, fork: tuple[Envelope, Envelope]) -> bool:
        """Whether ``snapshot`` is a later full snapshot of the fork's document holding both sides."""
        if not snapshot.full or any(e.doc != snapshot.doc or e.seq >= snapshot.seq for e in fork):
            return False
        try:
            doc = _doc_from(snapshot.update)
            reference = doc.get_update()
            for env in fork:
                doc.apply_update(env.update)
        except Exception:  # noqa: BLE001 - pycrdt (Rust) raises its own kinds for an undecodable update
            return False
        return doc.get_update() == reference

    def _copy_of(self, env: Envelope) -> Envelope | None:
        stream = self._streams.get(env.stream)
        if stream is not None:
            held = stream.find(env.seq) or (stream.pending.get(env.seq) or (None, 0.0))[0]
            if held is not None:
                return held
        return self._loose.get((env.doc, env.writer, env.seq))

    def _remember_loose(self, env: Envelope) -> None:
        self._loose[(env.doc, env.writer, env.seq)] = env
        while len(self._loose) > _MAX_LOOSE:
            self._loose.popitem(last=False)

    def _ban(self, writer: str, evidence: tuple[Envelope, Envelope]) -> None:
        self._forget_writer(writer)
        self._loose = OrderedDict((k, e) for k, e in self._loose.items() if k[1] != writer)
        ordered = tuple(sorted(evidence, key=lambda e: (e.sig, e.update)))  # the same pair everywhere
        self._banned[writer] = (ordered[0], ordered[1])
        self._new_evidence.extend(ordered)
        while len(self._banned) > self.limits.max_banned:
            self._banned.popitem(last=False)

    def _forget_writer(self, writer: str) -> None:
        for key in [k for k in self._streams if k[1] == writer]:
            self._pending_total -= len(self._streams.pop(key).pending)
            self._docs.pop(key[0], None)
            if key[0] == CONFIG_DOC:  # shared by the admins: rebuilt from the others' streams
                config = self._doc(CONFIG_DOC)
                for other in sorted(k for k in self._streams if k[0] == CONFIG_DOC):
                    for env in self._streams[other].retained:
                        config.apply_update(env.update)

    def banned(self) -> list[str]:
        """Writers banned for equivocating, in the order they were caught."""
        return list(self._banned)

    def take_new_evidence(self) -> list[Envelope]:
        """Evidence envelopes of bans since the last call (the owner persists them)."""
        evidence, self._new_evidence = self._new_evidence, []
        return evidence

    # -- departed writers ------------------------------------------------------------------------

    def forget_departed(self, members: Mapping[str, MemberRecord], *, now_ms: int, after_ms: int) -> list[str]:
        """Drop the documents and streams of writers whose lease ended more than ``after_ms``
        before ``now_ms`` (one that left cleanly wrote an ended lease); ``members`` are the
        records of ``snapshot()``. Ourselves and admins are kept. A forgotten writer's envelopes
        up to the seq we held are refused from then on (``departed``: a peer that has not
        forgotten it yet offers them again), later ones taken from its next snapshot on (a member
        that comes back writes one within ``snapshot_every`` envelopes, much sooner once its
        stream has been compacted). Returns the writers forgotten."""
        gone = []
        for writer, record in sorted(members.items()):
            if writer == self.peer_id or writer in self.admins or writer in self._banned:
                continue
            if record["lease_expires_ms"] + after_ms >= now_ms or not (record["left"] or record["lease_expires_ms"]):
                continue  # live, lately gone, or no lease written yet
            stream = self._streams.get((writer, writer))
            self._departed[writer] = stream.have if stream is not None else 0
            self._departed.move_to_end(writer)
            self._forget_writer(writer)
            gone.append(writer)
        while len(self._departed) > _MAX_EVICTED:
            self._departed.popitem(last=False)
        return gone

    # -- time ----------------------------------------------------------------------------------

    def tick(self, now: float) -> int:
        """Advance the owner's clock to ``now`` (seconds, monotonic); drop early arrivals that
        waited longer than ``pending_ttl``. Returns how many were dropped."""
        self._now = now
        dropped = 0
        for stream in self._streams.values():
            stale = [s for s, (_, at) in stream.pending.items() if now - at > self.limits.pending_ttl]
            for seq in stale:
                del stream.pending[seq]
            dropped += len(stale)
        self._pending_total -= dropped
        return dropped

    def pending_count(self) -> int:
        return self._pending_total

    # -- anti-entropy --------------------------------------------------------------------------

    def state_vector(self) -> list[list[str | int]]:
        """``[[doc, writer, have, head], ...]``: ``head`` names the envelope at ``have``, so two
        replicas that hold different envelopes under the same seqs (a fork) can tell. Our own
        streams are left out while we hold them: a peer then sends all it holds of them."""
        return [
            [doc, writer, s.have, _digest(s.retained[-1])]
            for (doc, writer), s in self._published_streams() if s.have and s.retained
        ]

    def _published_streams(self) -> list[tuple[StreamKey, _Stream]]:
        return [
            (key, stream) for key, stream in sorted(self._streams.items())
            if not (self._holding and key[1] == self.peer_id)
        ]

    def missing_for(self, vector: object) -> list[Envelope]:
        """Envelopes a replica whose ``state_vector()`` is ``vector`` lacks (unknown rows ignored),
        our envelope at its head where the two differ (it proves the fork to the other side), and
        the evidence against every banned writer it still holds."""
        theirs = _parse_rows(vector)
        missing: list[Envelope] = []
        for key, stream in self._published_streams():
            their_have, their_head = theirs.get(key, (0, None))
            ours_there = stream.find(their_have) if their_head is not None else None
            if ours_there is not None and _digest(ours_there) != their_head:
                missing.append(ours_there)
            if stream.have > their_have:
                missing.extend(env for env in stream.retained if env.seq > their_have)
        for writer in sorted({w for (_, w), (have, _) in theirs.items() if have and w in self._banned}):
            missing.extend(self._banned[writer])
        return missing

    def wants_from(self, vector: object) -> bool:
        """Whether a replica with ``vector`` holds something we lack (and would take)."""
        return any(
            have > (self._streams[key].have if key in self._streams else self._departed.get(key[1], 0))
            for key, have in parse_state_vector(vector).items()
            if key[1] not in self._banned and (key[1] not in self._evicted or self._protected(key[1]))
        )

    # -- reading -------------------------------------------------------------------------------

    def retained(self) -> list[Envelope]:
        """What a replica needs to rebuild this one: every stream, then the evidence of bans."""
        streams = [env for _, s in sorted(self._streams.items()) for env in s.retained]
        return streams + [env for pair in self._banned.values() for env in pair]

    def state_bytes(self) -> int:
        return sum(s.retained_bytes() for s in self._streams.values())

    def have(self, doc: str, writer: str) -> int:
        stream = self._streams.get((doc, writer))
        return stream.have if stream else 0

    def writers(self) -> set[str]:
        return {writer for _, writer in self._streams}

    def snapshot(self) -> Snapshot:
        writer_docs = {name: doc for name, doc in self._docs.items() if name != CONFIG_DOC}
        return build_snapshot(writer_docs, self._docs.get(CONFIG_DOC))

    def counters(self) -> dict[str, int | dict[str, int]]:
        return {
            "updates_accepted": self.accepted,
            "updates_rejected": dict(sorted(self.rejected.items())),
            "state_bytes": self.state_bytes(),
            "streams": len(self._streams),
            "pending": self._pending_total,
            "banned_writers": len(self._banned),
            "evicted_writers": len(self._evicted),
            "departed_writers": len(self._departed),
            "superseded_own": self.superseded,
        }

    # -- internals -----------------------------------------------------------------------------

    def _doc(self, name: str) -> Doc[Map[object]]:
        doc = self._docs.get(name)
        if doc is None:
            doc = self._docs[name] = Doc()
        return doc

    def _stream(self, key: StreamKey) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        return stream

    def _keep(self, stream: _Stream, env: Envelope) -> None:
        if env.writer == self.peer_id:  # known as ours once a snapshot has compacted it away
            self._own_signed[_digest(env)] = None
            while len(self._own_signed) > _MAX_OWN_SIGNED:
                self._own_signed.popitem(last=False)
        stream.have = env.seq
        if env.full:
            stream.retained = [env]
        else:
            stream.retained.append(env)


def _doc_from(update: bytes) -> Doc[Map[object]]:
    doc: Doc[Map[object]] = Doc()
    doc.apply_update(update)
    return doc


def _digest(env: Envelope) -> str:
    """A short name for an envelope (its Ed25519 signature is deterministic in its content)."""
    return hashlib.sha256(env.sig).hexdigest()[:16]


def parse_state_vector(vector: object, *, max_rows: int = 100_000) -> Mapping[StreamKey, int]:
    """Untrusted ``[[doc, writer, have(, head)], ...]`` -> mapping; malformed rows are skipped."""
    return {key: have for key, (have, _) in _parse_rows(vector, max_rows=max_rows).items()}


def _parse_rows(vector: object, *, max_rows: int = 100_000) -> dict[StreamKey, tuple[int, str | None]]:
    result: dict[StreamKey, tuple[int, str | None]] = {}
    if not isinstance(vector, list | tuple):
        return result
    for row in list(vector)[:max_rows]:
        if (
            isinstance(row, list | tuple)
            and len(row) in (3, 4)
            and isinstance(row[0], str)
            and isinstance(row[1], str)
            and type(row[2]) is int
            and row[2] >= 0
        ):
            head = row[3] if len(row) == 4 and isinstance(row[3], str) and len(row[3]) <= 64 else None
            result[(row[0], row[1])] = (row[2], head)
    return result
