"""Heartbeats and leases: who is a live member, decided the same way on every node.

Each member renews its own lease by writing ``lease_expires_ms`` (wall-clock ms, its own
clock) into its membership record every ``heartbeat_interval``; a lease lasts ``lease``.
A member that shuts down cleanly writes ``left = True`` and an expired lease, which reaches
the others with the next push instead of after the lease runs out.

``live_members(members, now_ms)`` is a pure function of the replicated records and a time,
so two nodes holding the same (converged) state and evaluating at the same instant agree
exactly; evaluated on different nodes "now", they agree as long as clocks are within
``clock_skew`` of each other — the margin is added on the reading side, so a node whose clock
runs slightly ahead does not evict members early. For a round-scoped decision the trainer
should pass one agreed timestamp (e.g. the round's start) as ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LeasePolicy:
    heartbeat_interval: float = 1.0
    lease: float = 5.0
    clock_skew: float = 0.5

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if self.lease < 2 * self.heartbeat_interval:
            raise ValueError("lease must be at least twice the heartbeat interval")
        if self.clock_skew < 0:
            raise ValueError("clock_skew must be >= 0")

    def lease_expiry_ms(self, now_ms: int) -> int:
        return now_ms + int(self.lease * 1000)


def is_live(record: Mapping[str, Any], *, now_ms: int, clock_skew_ms: int = 0) -> bool:
    if record.get("left") is True:
        return False
    expires = record.get("lease_expires_ms")
    return type(expires) is int and expires + clock_skew_ms >= now_ms


def live_members(
    members: Mapping[str, Mapping[str, Any]], *, now_ms: int, clock_skew_ms: int = 0
) -> list[str]:
    """Sorted peer ids whose lease covers ``now_ms`` and who have not left."""
    return sorted(
        peer for peer, record in members.items()
        if is_live(record, now_ms=now_ms, clock_skew_ms=clock_skew_ms)
    )
