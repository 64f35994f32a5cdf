"""Heartbeats, leases and proof of presence: who is a live member, decided the same way on every node.

Each member renews its own lease by writing ``lease_expires_ms`` (wall-clock ms, its own
clock) into its membership record every ``heartbeat_interval``; a lease lasts ``lease``.
A member that shuts down cleanly writes ``left = True`` and an expired lease, which reaches
the others with the next push instead of after the lease runs out.

``live_members(members, now_ms)`` is a pure function of the replicated records and a time,
so two nodes holding the same (converged) state and evaluating at the same instant agree
exactly; evaluated on different nodes "now", they agree as long as clocks are within
``clock_skew`` of each other — the margin is added on the reading side, so a node whose clock
runs slightly ahead does not evict members early. For a round-scoped decision the trainer
should pass one agreed timestamp (e.g. the round's start) as ``now_ms``. A lease that ends more
than ``lease + max_clock_ahead`` after the reader's clock is no lease at all (a record claiming
to be live until 2036 is not live).

A record is only a claim: anyone who can write to the run can sign records with throwaway keys.
So a member counts only when it is *verified* (``verified_writers``): it proved itself to us on
a live, authenticated connection (a completed state-sync session on a connection whose peer id
is the writer's key, which the access gate admitted when the run has a secret), or enough
members that proved themselves to us *vouch* for it — each member lists in its record (``peers``)
the peers that proved themselves to it. Enough is two when at least two members proved
themselves to us (one dishonest member cannot add members on its own), one when only one did
(a newcomer that knows only its bootstrap peer takes its word, and dials the others it names).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LeasePolicy:
    heartbeat_interval: float = 1.0
    lease: float = 5.0
    clock_skew: float = 0.5
    max_clock_ahead: float = 10.0  # how far a writer's clock may run ahead of the reader's

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if self.lease < 2 * self.heartbeat_interval:
            raise ValueError("lease must be at least twice the heartbeat interval")
        if self.clock_skew < 0:
            raise ValueError("clock_skew must be >= 0")
        if self.max_clock_ahead < 0:
            raise ValueError("max_clock_ahead must be >= 0")

    def lease_expiry_ms(self, now_ms: int) -> int:
        return now_ms + int(self.lease * 1000)

    @property
    def max_ahead_ms(self) -> int:
        """The furthest a lease may end after the reader's clock."""
        return int((self.lease + self.max_clock_ahead) * 1000)


def is_live(
    record: Mapping[str, object], *, now_ms: int, clock_skew_ms: int = 0, max_ahead_ms: int | None = None
) -> bool:
    if record.get("left") is True:
        return False
    expires = record.get("lease_expires_ms")
    if type(expires) is not int:
        return False
    if max_ahead_ms is not None and expires - now_ms > max_ahead_ms:
        return False  # a lease far in the future: a forged or broken clock, not a member
    return expires + clock_skew_ms >= now_ms


def live_members(
    members: Mapping[str, Mapping[str, object]],
    *,
    now_ms: int,
    clock_skew_ms: int = 0,
    max_ahead_ms: int | None = None,
    verified: Collection[str] | None = None,
) -> list[str]:
    """Sorted peer ids whose lease covers ``now_ms``, who have not left, and (when ``verified``
    is given) who are in it."""
    return sorted(
        peer for peer, record in members.items()
        if (verified is None or peer in verified)
        and is_live(record, now_ms=now_ms, clock_skew_ms=clock_skew_ms, max_ahead_ms=max_ahead_ms)
    )


MAX_VOUCHES = 128  # peers a member lists in its record
VOUCH_QUORUM = 2


def vouches(record: Mapping[str, object]) -> list[str]:
    peers = record.get("peers")
    if not isinstance(peers, list):
        return []
    return [p for p in peers if isinstance(p, str) and 0 < len(p) <= 128][:MAX_VOUCHES]


def verified_writers(
    members: Mapping[str, Mapping[str, object]],
    *,
    me: str,
    proven: Collection[str],
    now_ms: int,
    clock_skew_ms: int = 0,
    max_ahead_ms: int | None = None,
) -> set[str]:
    """Who counts as a member for us: ourselves, the peers that ``proven`` themselves to us,
    and peers vouched for by enough live members of those (see the module docstring)."""
    direct = set(proven) | {me}
    vouchers = [
        peer for peer in sorted(direct - {me})
        if peer in members
        and is_live(members[peer], now_ms=now_ms, clock_skew_ms=clock_skew_ms, max_ahead_ms=max_ahead_ms)
    ]
    quorum = min(VOUCH_QUORUM, len(vouchers))
    if quorum == 0:
        return direct
    counts: dict[str, int] = {}
    for voucher in vouchers:
        for peer in set(vouches(members[voucher])) - direct - {voucher}:
            counts[peer] = counts.get(peer, 0) + 1
    return direct | {peer for peer, count in counts.items() if count >= quorum}
