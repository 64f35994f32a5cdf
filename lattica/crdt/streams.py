"""A writer's stream of envelopes as a replica holds it, and the state vectors that name streams — sans-IO.

A *stream* is the sequence of envelopes one writer produced for one document (``StreamKey``:
document, writer). A replica's state vector lists, per stream it holds, ``[doc, writer, have,
head]``: the highest contiguous seq applied and a short name of the envelope at it (``digest``),
so two replicas that hold different envelopes under the same seq (a fork) can tell. Vectors come
from peers: ``parse_vector_rows`` keeps the well-formed rows only.

Anti-entropy is two pure functions: ``vector_rows`` (a replica's streams -> its state vector)
and ``missing_from`` (the envelopes a peer with a given vector lacks). Yjs updates commute and
are idempotent, so replicas that hold the same envelopes hold identical documents, whatever the
delivery order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lattica.crdt.envelope import Envelope


@dataclass
class Stream:
    """One writer's envelopes for one document: applied up to ``have``, what a peer needs to reach
    ``have`` (``retained``), and early arrivals waiting for their predecessors (``pending``)."""

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

    def keep(self, env: Envelope) -> None:
        """Hold ``env`` as the stream's newest; a full snapshot replaces what came before."""
        self.have = env.seq
        if env.full:
            self.retained = [env]
        else:
            self.retained.append(env)


StreamKey = tuple[str, str]


def digest(env: Envelope) -> str:
    """A short name for an envelope (its Ed25519 signature is deterministic in its content)."""
    return hashlib.sha256(env.sig).hexdigest()[:16]


def parse_state_vector(vector: object, *, max_rows: int = 100_000) -> Mapping[StreamKey, int]:
    """Untrusted ``[[doc, writer, have(, head)], ...]`` -> mapping; malformed rows are skipped."""
    return {key: have for key, (have, _) in parse_vector_rows(vector, max_rows=max_rows).items()}


def parse_vector_rows(vector: object, *, max_rows: int = 100_000) -> dict[StreamKey, tuple[int, str | None]]:
    """Untrusted ``[[doc, writer, have(, head)], ...]`` -> stream -> (have, head); malformed rows are skipped."""
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


def vector_rows(streams: Iterable[tuple[StreamKey, Stream]]) -> list[list[str | int]]:
    """``[[doc, writer, have, head], ...]`` for the ``streams`` that hold anything."""
    return [[doc, writer, s.have, digest(s.retained[-1])] for (doc, writer), s in streams if s.have and s.retained]


def missing_from(
    streams: Iterable[tuple[StreamKey, Stream]], theirs: Mapping[StreamKey, tuple[int, str | None]]
) -> list[Envelope]:
    """The envelopes of ``streams`` that a replica whose parsed vector is ``theirs`` lacks, and
    ours at its head where the two differ (it proves the fork to the other side)."""
    missing: list[Envelope] = []
    for key, stream in streams:
        their_have, their_head = theirs.get(key, (0, None))
        ours_there = stream.find(their_have) if their_head is not None else None
        if ours_there is not None and digest(ours_there) != their_head:
            missing.append(ours_there)
        if stream.have > their_have:
            missing.extend(env for env in stream.retained if env.seq > their_have)
    return missing
