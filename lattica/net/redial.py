"""When to dial a known peer again: bootstrap peers and members seen before, with backoff.

Theory of operation (sans-IO; the connectivity's redial loop asks it once a tick). A peer is a
redial candidate while it is not connected and is a bootstrap peer (``--peer``), or a member
we were connected to in this life or the one before (the saved peer book). The first dial of
a candidate comes at once, then with pauses doubling from ``first_pause_s`` to ``max_pause_s``
until it connects (which clears its entry). A peer that said goodbye is redialed too: a node
that stopped may be restarted with the same identity, and the swarm's founder has no
``--peer`` to come back through. Its first dial waits ``left_first_pause_s`` (it is still
shutting down), then pauses double up to ``left_max_pause_s``; when it dials us first, its
connection is accepted at once like any other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RedialPolicy:
    first_pause_s: float = 1.0
    max_pause_s: float = 30.0
    left_first_pause_s: float = 5.0
    left_max_pause_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.first_pause_s <= self.max_pause_s:
            raise ValueError("RedialPolicy needs 0 < first_pause_s <= max_pause_s")
        if not 0 < self.left_first_pause_s <= self.left_max_pause_s:
            raise ValueError("RedialPolicy needs 0 < left_first_pause_s <= left_max_pause_s")


class RedialSchedule:
    """Per candidate: when its next dial is due and the pause after that one."""

    def __init__(self, policy: RedialPolicy) -> None:
        self.policy = policy
        self._next: dict[str, tuple[float, float]] = {}

    def due(self, peer_id: str, *, now: float, left: bool) -> bool:
        """Whether to dial ``peer_id`` now; when it is, the following dial is scheduled."""
        policy = self.policy
        entry = self._next.get(peer_id)
        if entry is None:
            first = policy.left_first_pause_s if left else 0.0
            entry = self._next[peer_id] = (now + first, policy.left_first_pause_s if left else policy.first_pause_s)
        at, pause = entry
        if now < at:
            return False
        ceiling = policy.left_max_pause_s if left else policy.max_pause_s
        self._next[peer_id] = (now + pause, min(pause * 2, ceiling))
        return True

    def forget(self, peer_id: str) -> None:
        """``peer_id`` is connected (or no candidate any more): its next loss starts afresh."""
        self._next.pop(peer_id, None)

    def keep_only(self, candidates: set[str]) -> None:
        for peer_id in [p for p in self._next if p not in candidates]:
            del self._next[peer_id]
