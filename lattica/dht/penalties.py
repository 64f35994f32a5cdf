"""Bookkeeping for peers that sent bad DHT input (sans-IO).

Each rejected input is counted. The first rejection of a peer starts a ban of
``ban_seconds``; only that first one is reported as "new" so the caller logs it once and
drops the peer, instead of logging every frame of a flood. While banned, the peer's inbound
DHT streams are reset unread.
"""

from __future__ import annotations

from collections import Counter


class PenaltyBox:
    def __init__(self, *, ban_seconds: float) -> None:
        self._ban_seconds = ban_seconds
        self._banned_until: dict[str, float] = {}
        self.rejected_inputs = 0
        self.reasons: Counter[str] = Counter()

    def reject(self, peer_id: str, reason: str, *, now: float) -> bool:
        """Count one rejected input; True when the peer was not already banned."""
        self.rejected_inputs += 1
        self.reasons[reason] += 1
        first = not self.is_banned(peer_id, now=now)
        if first:
            self._banned_until[peer_id] = now + self._ban_seconds
        return first

    def is_banned(self, peer_id: str, *, now: float) -> bool:
        until = self._banned_until.get(peer_id)
        if until is None:
            return False
        if until <= now:
            del self._banned_until[peer_id]
            return False
        return True

    def banned_peers(self, *, now: float) -> list[str]:
        return [p for p in list(self._banned_until) if self.is_banned(p, now=now)]
