"""Which peers a node syncs with, when, and with which hello — sans-IO.

Theory of operation
-------------------
A session opens with both sides' state vectors (one row per document and writer), so a
session costs about two vectors, i.e. grows with the members; a node that ran one with every
connected peer whenever its state changed (every lease renewal) moved ~2 x peers x members
rows a second — quadratic in the swarm, 96 % of the sync bytes at 100 members
(``docs/scale.md``). So a node pushes what it learns as a rumour and repairs rarely:

- **News.** ``News`` records the streams whose ``have`` rose here (our writes and envelopes we
  accepted) with the time. The rows of the streams that changed in the last ``news_window_s``
  are the node's *news*.
- **Push to a few.** Each period (the service's ``sync_interval``), when there is news, the node
  runs a *partial* session with ``fanout`` peers drawn at random among those it may sync with:
  its hello lists the news rows only, the answer lists the answerer's rows for those streams
  where it differs (nothing for a rumour it heard already), and each side sends the envelopes of
  those streams the other lacks. A peer that learns
  something has news of it in turn, so an envelope reaches every member in about log_fanout(N)
  periods, and a member hears each row about ``fanout x news_window_s / period`` times and
  answers it once, whatever the number of its connections.
- **A small swarm** (a node with at most ``push_all_up_to`` peers) syncs as version 1 did,
  *eagerly*: a full session with each peer as soon as the state changed since the last one with
  it, and at least every period (``eager_due``), so that its members see each other's leases,
  progress and returns within a session's time, not a period's. Its sessions cost a few rows
  each, whatever the swarm does.
- **Proofs.** A completed session proves a peer to us for a lease (``liveness.ProvenPeers``);
  the peers whose proof is older than half a lease get a session too (``refresh``; its hello
  lists no rows unless it also pushes), so a member with standing keeps it whatever the draw.
- **Repair.** Every ``repair_interval_s`` (jittered +-50 %) the node runs one *full* session
  (both whole vectors, as the first protocol version always did) with a random peer: what a
  rumour missed (a lost session, a partition) is found there, and a banned writer's evidence
  reaches those still holding it. The sessions of a node that has not completed a full one
  yet (a newcomer, a restart that holds its own streams) are full, ``fanout`` at a time.

``SyncPlan.due`` is the schedule of a larger swarm: the peers and the kind of session for this
period; ``SyncPlan.eager_due`` that of a small one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from lattica.crdt.streams import StreamKey


@dataclass(frozen=True, kw_only=True)
class SyncPolicy:
    fanout: int = 3
    push_all_up_to: int = 8
    news_window_s: float = 1.5
    repair_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.fanout < 1 or self.push_all_up_to < 0:
            raise ValueError("fanout must be >= 1 and push_all_up_to >= 0")
        if not self.news_window_s > 0:
            raise ValueError("news_window_s must be positive")
        if not self.repair_interval_s > 0:
            raise ValueError("repair_interval_s must be positive")


class News:
    """The streams that changed here lately, with when."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._changed: dict[StreamKey, float] = {}

    def note(self, keys: Iterable[StreamKey], now: float) -> None:
        for key in keys:
            self._changed.pop(key, None)
            self._changed[key] = now  # insertion order: oldest first

    def keys(self, now: float) -> set[StreamKey]:
        """The streams changed within the window (older ones are dropped)."""
        horizon = now - self.window_s
        for key, at in list(self._changed.items()):
            if at >= horizon:
                break
            del self._changed[key]
        return set(self._changed)


@dataclass(frozen=True)
class Session:
    peer: str
    full: bool
    news: bool = True  # a partial session's hello lists our news (else nothing: a proof only)


class SyncPlan:
    """The sessions a node starts, period by period (see the module docstring)."""

    def __init__(self, policy: SyncPolicy, *, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng or random.Random()
        self.repaired = False  # a full session completed (we hold the swarm's state once)
        self._next_repair: float | None = None
        self._synced: dict[str, tuple[int, float]] = {}  # eager: peer -> (generation, when) of its last session

    def eager(self, peers: Collection[str]) -> bool:
        """Whether a node with ``peers`` (all it may sync with) is in a small swarm."""
        return len(peers) <= self.policy.push_all_up_to

    def eager_due(
        self, peers: Collection[str], ready: Collection[str], now: float, *, generation: int, period: float,
    ) -> list[Session]:
        """A small swarm's sessions: a full one with each of ``ready`` (those of ``peers`` not
        busy or backed off) whose last completed session started before the state's latest change
        (``generation``) or ended ``period`` ago."""
        self._synced = {p: at for p, at in self._synced.items() if p in peers}
        return [Session(p, True) for p in ready if self._eager_next(p, generation, period) <= now]

    def next_eager_at(self, peers: Iterable[str], *, generation: int, period: float) -> float:
        """When the next of ``peers`` falls due in a small swarm, the state unchanged."""
        return min((self._eager_next(p, generation, period) for p in peers), default=math.inf)

    def synced(self, peer: str, *, generation: int, now: float) -> None:
        """A session with ``peer`` that started at ``generation`` completed at ``now``."""
        self._synced[peer] = (generation, now)

    def _eager_next(self, peer: str, generation: int, period: float) -> float:
        synced_generation, at = self._synced.get(peer, (-1, -math.inf))
        return -math.inf if synced_generation != generation else at + period

    def due(
        self, peers: Sequence[str], now: float, *, news: bool, holding: bool, refresh: Collection[str] = (),
    ) -> list[Session]:
        """The sessions to run now with some of ``peers`` (those we may sync with now), and with
        those of ``refresh`` (peers whose proof ages) that no other session of the wave reaches."""
        sessions = self._planned(peers, now, news=news, holding=holding)
        reached = {s.peer for s in sessions}
        return sessions + [Session(p, holding, news=False) for p in peers if p in refresh and p not in reached]

    def _planned(self, peers: Sequence[str], now: float, *, news: bool, holding: bool) -> list[Session]:
        if not peers:
            return []
        fanout = len(peers) if len(peers) <= self.policy.push_all_up_to else self.policy.fanout
        if holding or not self.repaired:
            return [Session(p, True) for p in self._draw(peers, fanout)]
        sessions = [Session(p, False) for p in self._draw(peers, fanout)] if news else []
        if self._next_repair is None:
            self._next_repair = now + self._jittered()
        elif now >= self._next_repair:
            self._next_repair = now + self._jittered()
            repair = self._draw(peers, 1)[0]
            sessions = [s for s in sessions if s.peer != repair] + [Session(repair, True)]
        return sessions

    def completed(self, session: Session) -> None:
        if session.full:
            self.repaired = True

    def _draw(self, peers: Sequence[str], count: int) -> list[str]:
        return self.rng.sample(list(peers), min(count, len(peers)))

    def _jittered(self) -> float:
        return self.policy.repair_interval_s * self.rng.uniform(0.5, 1.5)

