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

Equivocation (a writer that signed two histories) is caught, banned and healed as
``lattica.crdt.equivocation`` describes; ``Bans`` holds the banned writers and their evidence.
Streams are compacted and departed members forgotten (``forget_departed``) as
``lattica.crdt.compaction`` describes. Anti-entropy (``state_vector()``, ``missing_for()``) is
``lattica.crdt.streams``'s.

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
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from pycrdt import Doc, Map

from lattica.crdt import compaction
from lattica.crdt.config import ReplicaLimits
from lattica.crdt.documents import CONFIG_DOC, MemberRecord, Snapshot, build_snapshot, doc_from, reassert
from lattica.crdt.envelope import (
    Envelope,
    RejectedUpdate,
    envelope_from_wire,
    sign_envelope,
    verify_envelope,
)
from lattica.crdt.equivocation import Bans, heals
from lattica.crdt.streams import Stream, StreamKey, missing_from, parse_state_vector, parse_vector_rows, vector_rows
from lattica.errors import LocalProtocolError

_MAX_EVICTED = 16_384  # evicted writers remembered (refused until trusted)


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
        self._streams: dict[StreamKey, Stream] = {}
        self._pending_total = 0  # early arrivals buffered over all streams
        self._now = 0.0  # the owner's clock, as of the last ``tick``
        self._evicted: OrderedDict[str, None] = OrderedDict()  # writers refused until trusted
        self._bans = Bans(max_banned=self.limits.max_banned)  # equivocating writers, their evidence
        self._departed = compaction.Departed()  # forgotten writers (``forget_departed``)
        self._own = compaction.OwnEnvelopes(self.peer_id)  # ours, recognized once compacted away
        self._holding = False  # our own streams are not published (see "A writer's own history")
        self._own_seen: dict[StreamKey, int] = {}  # our streams -> highest seq absorbed
        self._this_life: dict[str, Doc[Map[object]]] = {}  # our document as this life wrote it
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
        if compaction.snapshot_due(stream, self.limits.snapshot_every, len(doc.get_update())):
            doc = self._docs[doc_name] = compaction.without_history(doc_name, doc)
            envelopes.append(self._sign_and_keep(stream, doc_name, doc.get_update(), full=True))
        return envelopes

    def _sign_and_keep(
        self, stream: Stream, doc_name: str, update: bytes, *, full: bool, seq: int | None = None
    ) -> Envelope:
        cap = self.limits.max_snapshot_bytes if full else self.limits.max_update_bytes
        if len(update) > cap:
            raise LocalProtocolError(f"update of {len(update)} bytes exceeds the {cap}-byte limit")
        env = sign_envelope(
            self.key_pair, run=self.run_id, doc=doc_name, seq=seq or stream.have + 1, full=full, update=update
        )
        stream.keep(env)
        self._own.note(env)
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
        if env.writer in self._bans:
            if not heals(env, self._bans.evidence(env.writer)):
                raise RejectedUpdate("banned", f"{env.writer} equivocated", peer_id=from_peer)
            self._bans.lift(env.writer)
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

    def _admit(self, env: Envelope, from_peer: str | None) -> Stream:
        """The envelope's stream, making room for a new writer by evicting an untrusted one."""
        stream = self._streams.get(env.stream)
        if stream is not None:
            return stream
        if self._departed.refuses(env):
            raise RejectedUpdate("departed", f"{env.writer} left the run", peer_id=from_peer)
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

    def _buffer(self, stream: Stream, env: Envelope) -> None:
        if env.seq in stream.pending:  # the same envelope again (a different one is caught above)
            return
        if (
            len(stream.pending) < self.limits.max_pending_per_stream
            and self._pending_total < self.limits.max_pending_total
        ):
            stream.pending[env.seq] = (env, self._now)
            self._pending_total += 1
        else:
            self._bans.remember_loose(env)

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

    def _replay(self, stream: Stream, env: Envelope, from_peer: str | None) -> list[Envelope]:
        if stream.find(env.seq) is None:
            self._bans.remember_loose(env)  # compacted away: compare it with the next copy instead
        raise RejectedUpdate("replay", f"seq {env.seq} already applied", peer_id=from_peer)

    def _apply(self, stream: Stream, env: Envelope, from_peer: str | None) -> Envelope:
        if not env.full and stream.retained_bytes() + len(env.update) > self.limits.max_stream_bytes:
            raise RejectedUpdate("oversized", "stream exceeds its byte budget", peer_id=from_peer)
        try:
            compaction.apply_envelope(self._docs, env)
        except Exception as exc:  # noqa: BLE001 - pycrdt (Rust) raises its own kinds for an undecodable update from the wire
            raise RejectedUpdate("bad_update", f"undecodable update: {exc}", peer_id=from_peer) from None
        stream.keep(env)
        self._own.note(env)
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
        if stream.find(env.seq) == env or env in self._own:  # held, or compacted away
            return self._replay(stream, env, from_peer)
        follows = env.seq == stream.have + 1 or (env.full and env.seq > stream.have)
        if follows and not self._holding:
            return [self._apply(stream, env, from_peer)]
        return self._absorb(stream, env, from_peer)

    def _absorb(self, stream: Stream, env: Envelope, from_peer: str | None) -> list[Envelope]:
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
            self._this_life[env.doc] = doc_from(before)
        self._own_seen[env.stream] = max(self._own_seen.get(env.stream, 0), env.seq)
        self._holding = True
        return []

    # -- equivocation, departed writers ---------------------------------------------------------

    def _check_equivocation(self, env: Envelope, from_peer: str | None) -> None:
        """Ban ``env.writer`` if another signed envelope of it holds the same (doc, seq) and no
        snapshot of it that we hold has healed that fork."""
        other = self._copy_of(env)
        if other is None or other == env:
            return
        if self._superseded(env, other):
            raise RejectedUpdate(
                "superseded", f"seq {env.seq} of {env.writer} is healed by a snapshot", peer_id=from_peer,
            )
        self._ban(env.writer, (other, env))
        raise RejectedUpdate(
            "equivocation", f"{env.writer} signed two different updates for seq {env.seq}", peer_id=from_peer
        )

    def _superseded(self, env: Envelope, other: Envelope) -> bool:
        stream = self._streams.get(env.stream)
        snapshot = stream.retained[0] if stream is not None and stream.retained else None
        fork = (env, other)
        return snapshot is not None and (compaction.supersedes(snapshot, fork) or heals(snapshot, fork))

    def _copy_of(self, env: Envelope) -> Envelope | None:
        stream = self._streams.get(env.stream)
        if stream is not None:
            held = stream.find(env.seq) or (stream.pending.get(env.seq) or (None, 0.0))[0]
            if held is not None:
                return held
        return self._bans.loose_copy(env)

    def _ban(self, writer: str, evidence: tuple[Envelope, Envelope]) -> None:
        self._forget_writer(writer)
        self._bans.ban(writer, evidence)

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
        return self._bans.writers()

    def take_new_evidence(self) -> list[Envelope]:
        """Evidence envelopes of bans since the last call (the owner persists them)."""
        return self._bans.take_new_evidence()

    def forget_departed(self, members: Mapping[str, MemberRecord], *, now_ms: int, after_ms: int) -> list[str]:
        """Drop and return the writers gone ``after_ms`` before ``now_ms`` but us, admins, banned ones
        (``members``: ``snapshot()``'s; called now and then, it notes when each was first seen gone)."""
        kept = {self.peer_id, *self.admins, *self._bans.writers()}
        gone = self._departed.due(members, now_ms=now_ms, after_ms=after_ms, kept=kept)
        for writer in gone:
            self._departed.remember(writer, self.have(writer, writer))
            self._forget_writer(writer)
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
        return vector_rows(self._published_streams())

    def _published_streams(self) -> list[tuple[StreamKey, Stream]]:
        return [
            (key, stream) for key, stream in sorted(self._streams.items())
            if not (self._holding and key[1] == self.peer_id)
        ]

    def missing_for(self, vector: object) -> list[Envelope]:
        """Envelopes a replica whose ``state_vector()`` is ``vector`` lacks (unknown rows ignored),
        our envelope at its head where the two differ (it proves the fork to the other side), and
        the evidence against every banned writer it still holds."""
        theirs = parse_vector_rows(vector)
        banned = sorted({w for (_, w), (have, _) in theirs.items() if have and w in self._bans})
        return missing_from(self._published_streams(), theirs) + [e for w in banned for e in self._bans.evidence(w)]

    def wants_from(self, vector: object) -> bool:
        """Whether a replica with ``vector`` holds something we lack (and would take)."""
        return any(
            have > (self._streams[key].have if key in self._streams else self._departed.held(key[1]))
            for key, have in parse_state_vector(vector).items()
            if key[1] not in self._bans and (key[1] not in self._evicted or self._protected(key[1]))
        )

    # -- reading -------------------------------------------------------------------------------

    def retained(self) -> list[Envelope]:
        """What a replica needs to rebuild this one: every stream, then the evidence of bans."""
        streams = [env for _, s in sorted(self._streams.items()) for env in s.retained]
        return streams + self._bans.all_evidence()

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
            "banned_writers": len(self._bans),
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

    def _stream(self, key: StreamKey) -> Stream:
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = Stream()
        return stream
