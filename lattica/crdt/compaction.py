"""Compaction: a replica holds the run's present, not its whole history — sans-IO.

Theory of operation
-------------------
Yjs keeps every overwritten entry of a document as a tombstone, so a member's document would
grow by tens of bytes with every lease renewal, for ever. A writer's own stream is therefore
compacted: once the increments since its last snapshot hold more bytes than it (or after
``snapshot_every`` envelopes, ``snapshot_due``), the writer rebuilds its document from its
current content (``documents.compacted``) and signs that as the next ``full`` snapshot. A
replica that applies a writer's snapshot *replaces* its copy of that document with it (the
shared run config, written by several admins, is merged instead), so every replica holds about
twice a member's current document at most, whatever its history; a restart replays the snapshot
and the increments after it. A fork entirely below a writer's snapshot that a replica holds is
superseded, not a reason to ban: every replica ends on that snapshot.

The writer recognizes its own envelopes after compaction dropped them (``OwnEnvelopes``: the
digests of those it held), so a peer that sends one back is replaying it, not showing another
life of the writer.

Departed members are forgotten: ``Departed.due`` names the writers gone long ago (the state
service: ``StateConfig.forget_departed_after_s``) — since their lease's end, or, for one that
left cleanly (which writes no time), since this replica first saw it gone, so a clean leave stays
visible as such that long. The replica drops their documents and streams and remembers in
``Departed`` the seq it held of each, refusing those
envelopes again (``departed``: a peer that has not forgotten the writer yet offers them) and
taking a returning member from its next snapshot on. The state then holds the members of the
run, not of its whole history.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping

from pycrdt import Doc, Map

from lattica.crdt.documents import CONFIG_DOC, MemberRecord, compacted, doc_from
from lattica.crdt.envelope import Envelope
from lattica.crdt.streams import Stream, digest

MAX_DEPARTED = 16_384  # forgotten writers remembered
FIRST_SNAPSHOT_AFTER = 16  # envelopes of a stream that has no snapshot yet
MAX_OWN_ENVELOPES = 65_536  # our own envelopes recognized after compaction (older: superseded again)


def snapshot_due(stream: Stream, snapshot_every: int, document_bytes: int) -> bool:
    """A snapshot after ``snapshot_every`` envelopes, or once the increments since the last
    snapshot hold more bytes than it (a stream holds about twice its document at most); before
    the first, from ``FIRST_SNAPSHOT_AFTER`` envelopes on, once they hold more than a snapshot
    of the document (``document_bytes`` of update) would."""
    if len(stream.retained) >= snapshot_every:
        return True
    head = stream.retained[0]
    if head.full:
        return sum(env.encoded_size() for env in stream.retained[1:]) > head.encoded_size()
    snapshot_bytes = document_bytes + head.encoded_size() - len(head.update)
    held = sum(env.encoded_size() for env in stream.retained)
    return len(stream.retained) >= FIRST_SNAPSHOT_AFTER and held > snapshot_bytes


def without_history(doc_name: str, doc: Doc[Map[object]]) -> Doc[Map[object]]:
    """Our document ``doc_name`` rebuilt from its content alone; the run config, which several
    admins write, as it is."""
    return doc if doc_name == CONFIG_DOC else compacted(doc)


def apply_envelope(docs: dict[str, Doc[Map[object]]], env: Envelope) -> None:
    """Apply ``env`` to its document in ``docs``: a writer's snapshot of its own document
    replaces it, anything else is merged into it. Raises what pycrdt raises for a bad update."""
    if env.full and env.doc == env.writer:
        docs[env.doc] = doc_from(env.update)
        return
    doc = docs.get(env.doc)
    if doc is None:
        doc = docs[env.doc] = Doc()
    doc.apply_update(env.update)


def supersedes(snapshot: Envelope, fork: tuple[Envelope, Envelope]) -> bool:
    """Whether ``snapshot`` is its writer's snapshot of its own document above both sides of
    ``fork``: every replica replaces the document with it, so neither side survives anywhere."""
    return snapshot.full and snapshot.doc == snapshot.writer and all(e.seq < snapshot.seq for e in fork)


class Departed:
    """Writers forgotten because they left, each with the seq we held of its document; and when
    each member we hold was first seen gone."""

    def __init__(self, *, max_remembered: int = MAX_DEPARTED) -> None:
        self.max_remembered = max_remembered
        self._held: OrderedDict[str, int] = OrderedDict()
        self._gone_since: dict[str, int] = {}  # members seen gone -> when first seen so (ms)

    def due(
        self, members: Mapping[str, MemberRecord], *, now_ms: int, after_ms: int, kept: Container[str]
    ) -> list[str]:
        """The members gone more than ``after_ms`` before ``now_ms`` (see the module docstring),
        but those ``kept``; sorted."""
        gone_since = {}
        for writer, record in members.items():
            expires = record["lease_expires_ms"]
            if record["left"]:
                gone_since[writer] = min(self._gone_since.get(writer, now_ms), expires or now_ms)
            elif 0 < expires < now_ms:
                gone_since[writer] = expires
        self._gone_since = gone_since  # members back or forgotten are dropped
        return sorted(w for w, since in gone_since.items() if since + after_ms < now_ms and w not in kept)

    def __len__(self) -> int:
        return len(self._held)

    def remember(self, writer: str, held_seq: int) -> None:
        self._held[writer] = held_seq
        self._held.move_to_end(writer)
        while len(self._held) > self.max_remembered:
            self._held.popitem(last=False)

    def refuses(self, env: Envelope) -> bool:
        """Whether ``env`` is one we forgot; a later one brings its writer back (forgotten here)."""
        held = self._held.get(env.writer)
        if held is None:
            return False
        if env.seq <= held:
            return True
        del self._held[env.writer]
        return False

    def held(self, writer: str) -> int:
        return self._held.get(writer, 0)


class OwnEnvelopes:
    """The digests of the envelopes of ``writer`` (ourselves) held, bounded: ours even once
    compaction dropped them."""

    def __init__(self, writer: str, *, max_remembered: int = MAX_OWN_ENVELOPES) -> None:
        self.writer = writer
        self.max_remembered = max_remembered
        self._digests: OrderedDict[str, None] = OrderedDict()

    def note(self, env: Envelope) -> None:
        if env.writer != self.writer:
            return
        self._digests[digest(env)] = None
        while len(self._digests) > self.max_remembered:
            self._digests.popitem(last=False)

    def __contains__(self, env: object) -> bool:
        return isinstance(env, Envelope) and digest(env) in self._digests
