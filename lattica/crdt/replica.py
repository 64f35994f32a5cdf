"""The replica core: per-writer documents, signed streams, state vectors — sans-IO.

Theory of operation
-------------------
A *stream* is the sequence of envelopes one writer produced for one document: ``(peer, peer)``
for a writer's own document, ``("config", admin)`` for each admin's changes to the run config.
For every stream the replica keeps ``have`` (the highest contiguous seq applied) and the
envelopes needed to bring anyone else up to ``have``: either everything from seq 1, or a
``full`` snapshot followed by the increments after it. Invariants:

- an envelope is applied only after its signature, writer key and write permission checked;
- a stream's envelopes are applied in seq order; early arrivals wait in a small bounded
  buffer (or are dropped and fetched again by anti-entropy);
- a second copy of an applied seq is a replay: counted, never applied twice; a *different*
  envelope under an applied seq is an equivocation (``conflict``) and is rejected;
- a full snapshot at seq ``n`` supersedes every earlier envelope of its stream.

Anti-entropy is two pure functions: ``state_vector()`` (stream -> have) and
``missing_for(vector)`` (the envelopes a peer with that vector lacks). Yjs updates commute
and are idempotent, so replicas that hold the same envelopes hold identical documents,
whatever the delivery order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from pycrdt import Doc

from lattica.crdt.documents import CONFIG_DOC, build_snapshot
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
        if self.snapshot_every < 2:
            raise ValueError("snapshot_every must be >= 2")


@dataclass
class _Stream:
    have: int = 0
    retained: list[Envelope] = field(default_factory=list)
    pending: dict[int, Envelope] = field(default_factory=dict)

    def retained_bytes(self) -> int:
        return sum(len(env.update) for env in self.retained)

    def find(self, seq: int) -> Envelope | None:
        for env in self.retained:
            if env.seq == seq:
                return env
        return None


StreamKey = tuple[str, str]


class Replica:
    """One node's copy of the run state; feed it envelopes, ask it what peers miss."""

    def __init__(
        self,
        *,
        run_id: str,
        key_pair: KeyPair,
        admins: Iterable[str],
        limits: ReplicaLimits | None = None,
    ) -> None:
        self.run_id = run_id
        self.key_pair = key_pair
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        self.admins = frozenset(admins)
        self.limits = limits or ReplicaLimits()
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self._docs: dict[str, Doc] = {}
        self._streams: dict[StreamKey, _Stream] = {}
        self._pending_total = 0  # early arrivals buffered over all streams

    # -- local writes --------------------------------------------------------------------------

    def local_write(self, doc_name: str, mutate: Callable[[Doc], None]) -> list[Envelope]:
        """Apply ``mutate`` to one of our documents; return the envelopes to persist and send."""
        if doc_name == CONFIG_DOC and self.peer_id not in self.admins:
            raise LocalProtocolError("only admin keys may change the run config")
        if doc_name not in (CONFIG_DOC, self.peer_id):
            raise LocalProtocolError(f"cannot write another writer's document {doc_name!r}")
        doc = self._doc(doc_name)
        before = doc.get_state()
        mutate(doc)
        update = doc.get_update(before)
        if update == b"\x00\x00":  # nothing changed
            return []
        stream = self._stream((doc_name, self.peer_id))
        envelopes = [self._sign_and_keep(stream, doc_name, update, full=False)]
        if len(stream.retained) >= self.limits.snapshot_every:
            envelopes.append(self._sign_and_keep(stream, doc_name, doc.get_update(), full=True))
        return envelopes

    def _sign_and_keep(self, stream: _Stream, doc_name: str, update: bytes, *, full: bool) -> Envelope:
        cap = self.limits.max_snapshot_bytes if full else self.limits.max_update_bytes
        if len(update) > cap:
            raise LocalProtocolError(f"update of {len(update)} bytes exceeds the {cap}-byte limit")
        env = sign_envelope(
            self.key_pair, run=self.run_id, doc=doc_name, seq=stream.have + 1, full=full, update=update
        )
        self._keep(stream, env)
        self.accepted += 1
        return env

    # -- remote envelopes ----------------------------------------------------------------------

    def receive_wire(self, obj: Any, *, from_peer: str | None = None) -> list[Envelope]:
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
        self._check_permission(env, from_peer)
        stream = self._streams.get(env.stream)
        if stream is None:
            if len(self._streams) >= self.limits.max_streams:
                raise RejectedUpdate("too_many_writers", "stream table full", peer_id=from_peer)
            stream = self._stream(env.stream)
        if env.seq <= stream.have:
            return self._replay(stream, env, from_peer)
        if env.seq > stream.have + 1 and not env.full:
            if (
                len(stream.pending) < self.limits.max_pending_per_stream
                and self._pending_total < self.limits.max_pending_total
                and env.seq not in stream.pending
            ):
                stream.pending[env.seq] = env
                self._pending_total += 1
            return []
        applied = [self._apply(stream, env, from_peer)]
        while (nxt := stream.pending.get(stream.have + 1)) is not None:
            applied.append(self._apply(stream, nxt, from_peer))
        before = len(stream.pending)
        stream.pending = {s: e for s, e in stream.pending.items() if s > stream.have}
        self._pending_total -= before - len(stream.pending)
        return applied

    def _check_permission(self, env: Envelope, from_peer: str | None) -> None:
        if env.doc == env.writer:
            return
        if env.doc == CONFIG_DOC and env.writer in self.admins:
            return
        raise RejectedUpdate(
            "unauthorized", f"{env.writer} may not write document {env.doc!r}", peer_id=from_peer
        )

    def _replay(self, stream: _Stream, env: Envelope, from_peer: str | None) -> list[Envelope]:
        known = stream.find(env.seq)
        if known is not None and known != env:
            raise RejectedUpdate("conflict", f"two different updates for seq {env.seq}", peer_id=from_peer)
        raise RejectedUpdate("replay", f"seq {env.seq} already applied", peer_id=from_peer)

    def _apply(self, stream: _Stream, env: Envelope, from_peer: str | None) -> Envelope:
        if not env.full and stream.retained_bytes() + len(env.update) > self.limits.max_stream_bytes:
            raise RejectedUpdate("oversized", "stream exceeds its byte budget", peer_id=from_peer)
        try:
            self._doc(env.doc).apply_update(env.update)
        except Exception as exc:
            raise RejectedUpdate("bad_update", f"undecodable update: {exc}", peer_id=from_peer) from None
        self._keep(stream, env)
        self.accepted += 1
        return env

    # -- anti-entropy --------------------------------------------------------------------------

    def state_vector(self) -> list[list[Any]]:
        return [[doc, writer, s.have] for (doc, writer), s in sorted(self._streams.items()) if s.have]

    def missing_for(self, vector: Iterable[Any]) -> list[Envelope]:
        """Envelopes a replica whose ``state_vector()`` is ``vector`` lacks (unknown rows ignored)."""
        theirs = parse_state_vector(vector)
        missing: list[Envelope] = []
        for key, stream in sorted(self._streams.items()):
            their_have = theirs.get(key, 0)
            if stream.have > their_have:
                missing.extend(env for env in stream.retained if env.seq > their_have)
        return missing

    def wants_from(self, vector: Iterable[Any]) -> bool:
        """Whether a replica with ``vector`` holds something we lack."""
        return any(
            have > (self._streams[key].have if key in self._streams else 0)
            for key, have in parse_state_vector(vector).items()
        )

    # -- reading -------------------------------------------------------------------------------

    def retained(self) -> list[Envelope]:
        return [env for _, s in sorted(self._streams.items()) for env in s.retained]

    def state_bytes(self) -> int:
        return sum(s.retained_bytes() for s in self._streams.values())

    def have(self, doc: str, writer: str) -> int:
        stream = self._streams.get((doc, writer))
        return stream.have if stream else 0

    def snapshot(self) -> dict[str, Any]:
        writer_docs = {name: doc for name, doc in self._docs.items() if name != CONFIG_DOC}
        return build_snapshot(writer_docs, self._docs.get(CONFIG_DOC))

    def counters(self) -> dict[str, Any]:
        return {
            "updates_accepted": self.accepted,
            "updates_rejected": dict(sorted(self.rejected.items())),
            "state_bytes": self.state_bytes(),
            "streams": len(self._streams),
        }

    # -- internals -----------------------------------------------------------------------------

    def _doc(self, name: str) -> Doc:
        doc = self._docs.get(name)
        if doc is None:
            doc = self._docs[name] = Doc()
        return doc

    def _stream(self, key: StreamKey) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        return stream

    @staticmethod
    def _keep(stream: _Stream, env: Envelope) -> None:
        stream.have = env.seq
        if env.full:
            stream.retained = [env]
        else:
            stream.retained.append(env)


def parse_state_vector(vector: Any, *, max_rows: int = 100_000) -> Mapping[StreamKey, int]:
    """Untrusted ``[[doc, writer, have], ...]`` -> mapping; malformed rows are skipped."""
    result: dict[StreamKey, int] = {}
    if not isinstance(vector, list | tuple):
        return result
    for row in list(vector)[:max_rows]:
        if (
            isinstance(row, list | tuple)
            and len(row) == 3
            and isinstance(row[0], str)
            and isinstance(row[1], str)
            and type(row[2]) is int
            and row[2] >= 0
        ):
            result[(row[0], row[1])] = row[2]
    return result
