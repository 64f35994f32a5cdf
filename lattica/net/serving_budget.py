"""A node-wide budget for answers that send our state to whoever asks (sans-IO).

Some requests are a few bytes that make this node send a lot: a tensor ``fetch`` of the served
outer state, a state-sync session from a peer that holds nothing. Per-peer rations stop one
identity from asking too often, but identities are free: eight of them got 48 full states in
30 s. ``ServingBudget`` bounds what all of them together get:

- **Concurrency**: at most ``max_answers`` answers in flight at once.
- **Bytes**: a token bucket of ``burst_bytes`` refilled at ``bytes_per_s``. An answer goes out
  only while the bucket holds tokens, and takes its whole size at once (``try_take``, as soon as
  the size is known and before a byte is sent): it may leave the bucket in debt — an answer
  larger than the bucket still goes out when the bucket is full, and the next waits until the
  debt is paid. Over any interval of ``t`` seconds the node sends at most
  ``burst_bytes + bytes_per_s * t`` plus one answer.

An answer refused here is a *busy* answer, not a protocol violation: the asker tries later or
asks another holder. ``AnswerSlots`` adds a share per peer: at most ``per_peer`` of one peer's
requests answered at once (an honest peer asks one at a time). The caller passes the clock
(``now``, seconds, monotonic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    bytes_per_s: float
    burst_bytes: int
    max_answers: int

    def __post_init__(self) -> None:
        if not 0 < self.bytes_per_s < math.inf:
            raise ValueError(f"bytes_per_s must be a positive number, got {self.bytes_per_s!r}")
        if self.burst_bytes < 1:
            raise ValueError(f"burst_bytes must be at least 1, got {self.burst_bytes!r}")
        if self.max_answers < 1:
            raise ValueError(f"max_answers must be at least 1, got {self.max_answers!r}")


class ServingBudget:
    def __init__(self, limits: ServingLimits) -> None:
        self.limits = limits
        self.tokens = float(limits.burst_bytes)
        self.answers = 0  # in flight
        self.served = 0  # answers started
        self.served_bytes = 0
        self.busy = 0  # answers refused
        self._refilled_at: float | None = None

    def try_start(self, now: float) -> bool:
        """Start an answer if there is room for one now; False (counted as busy) if not."""
        self._refill(now)
        if self.answers >= self.limits.max_answers or self.tokens <= 0:
            self.busy += 1
            return False
        self.answers += 1
        self.served += 1
        return True

    def try_take(self, nbytes: int, now: float) -> bool:
        """Take a started answer's ``nbytes`` from the bucket, if it holds tokens now; False
        (counted as busy) if another answer emptied it since this one started."""
        self._refill(now)
        if self.tokens <= 0:
            self.busy += 1
            return False
        self.tokens -= nbytes
        self.served_bytes += nbytes
        return True

    def done(self) -> None:
        """An answer started with ``try_start`` went out (or failed)."""
        self.answers = max(0, self.answers - 1)

    def _refill(self, now: float) -> None:
        if self._refilled_at is not None and now > self._refilled_at:
            elapsed = now - self._refilled_at
            self.tokens = min(float(self.limits.burst_bytes), self.tokens + elapsed * self.limits.bytes_per_s)
        if self._refilled_at is None or now > self._refilled_at:
            self._refilled_at = now


class AnswerSlots:
    """The node's ``ServingBudget`` with a share per peer: ``start`` an answer, ``take`` its
    bytes, ``end`` it."""

    def __init__(self, budget: ServingBudget, *, per_peer: int) -> None:
        if per_peer < 1:
            raise ValueError(f"per_peer must be at least 1, got {per_peer!r}")
        self.budget, self.per_peer = budget, per_peer
        self._answering: dict[str, int] = {}  # peer -> answers in flight

    def start(self, peer: str, now: float) -> bool:
        """Room to answer ``peer``: its own share, then the node's budget."""
        if self._answering.get(peer, 0) >= self.per_peer:
            self.budget.busy += 1
            return False
        if not self.budget.try_start(now):
            return False
        self._answering[peer] = self._answering.get(peer, 0) + 1
        return True

    def take(self, nbytes: int, now: float) -> bool:
        return self.budget.try_take(nbytes, now)

    def end(self, peer: str) -> None:
        self.budget.done()
        remaining = self._answering.pop(peer, 1) - 1
        if remaining > 0:
            self._answering[peer] = remaining
