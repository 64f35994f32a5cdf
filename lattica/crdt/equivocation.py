"""Equivocation: a writer that signed two histories, caught, banned and healed — sans-IO.

Theory of operation
-------------------
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

``Bans`` is the replica's record of it: the banned writers (at most ``max_banned``, the oldest
forgotten first) with their evidence pair, the evidence not yet persisted, and the envelopes seen
but not held (a replay of a compacted seq, an early arrival the buffer had no room for), to
compare with the next copy of the same ``(doc, writer, seq)``.
"""

from __future__ import annotations

from collections import OrderedDict

from lattica.crdt.documents import doc_from
from lattica.crdt.envelope import Envelope

_MAX_LOOSE = 256  # envelopes seen but not held, kept to spot an equivocation among them
_SeqKey = tuple[str, str, int]  # doc, writer, seq


class Bans:
    """Writers banned for equivocating, with the evidence against each."""

    def __init__(self, *, max_banned: int) -> None:
        self.max_banned = max_banned
        self._banned: OrderedDict[str, tuple[Envelope, Envelope]] = OrderedDict()  # -> evidence
        self._new_evidence: list[Envelope] = []  # evidence not yet handed to ``take_new_evidence``
        self._loose: OrderedDict[_SeqKey, Envelope] = OrderedDict()  # seen, not held

    def __contains__(self, writer: str) -> bool:
        return writer in self._banned

    def __len__(self) -> int:
        return len(self._banned)

    def evidence(self, writer: str) -> tuple[Envelope, Envelope]:
        return self._banned[writer]

    def ban(self, writer: str, evidence: tuple[Envelope, Envelope]) -> None:
        """Ban ``writer``; the pair is kept in one order, the same at every replica."""
        self._loose = OrderedDict((k, e) for k, e in self._loose.items() if k[1] != writer)
        ordered = tuple(sorted(evidence, key=lambda e: (e.sig, e.update)))
        self._banned[writer] = (ordered[0], ordered[1])
        self._new_evidence.extend(ordered)
        while len(self._banned) > self.max_banned:
            self._banned.popitem(last=False)

    def lift(self, writer: str) -> None:
        """A snapshot healed ``writer``'s fork: it writes again."""
        del self._banned[writer]

    def writers(self) -> list[str]:
        """In the order they were caught."""
        return list(self._banned)

    def all_evidence(self) -> list[Envelope]:
        return [env for pair in self._banned.values() for env in pair]

    def take_new_evidence(self) -> list[Envelope]:
        evidence, self._new_evidence = self._new_evidence, []
        return evidence

    def remember_loose(self, env: Envelope) -> None:
        self._loose[(env.doc, env.writer, env.seq)] = env
        while len(self._loose) > _MAX_LOOSE:
            self._loose.popitem(last=False)

    def loose_copy(self, env: Envelope) -> Envelope | None:
        """A copy of ``env``'s (doc, writer, seq) seen but not held."""
        return self._loose.get((env.doc, env.writer, env.seq))


def heals(snapshot: Envelope, fork: tuple[Envelope, Envelope]) -> bool:
    """Whether ``snapshot`` is a later full snapshot of the fork's document holding both sides."""
    if not snapshot.full or any(e.doc != snapshot.doc or e.seq >= snapshot.seq for e in fork):
        return False
    try:
        doc = doc_from(snapshot.update)
        reference = doc.get_update()
        for env in fork:
            doc.apply_update(env.update)
    except Exception:  # noqa: BLE001 - pycrdt (Rust) raises its own kinds for an undecodable update
        return False
    return doc.get_update() == reference
