"""Heartbeats, leases and proof of presence: who is a live member, decided the same way on every node.

Each member renews its own lease by writing ``lease_expires_ms`` (wall-clock ms, its own
clock) into its membership record; a lease lasts ``lease``. Every write of a member's own record
(its round's progress, a role, its vouches) renews the lease with it, in the same envelope, and
the next renewal on its own falls due ``interval_for`` later: a member that publishes a round
at least that often renews no more than once a round. The interval grows with the swarm
(every renewal is an envelope every member receives): ``heartbeat_interval`` up to
``small_swarm`` members, then ``1 / renewals_per_s`` seconds more per member, at most
``max_heartbeat_interval``; a lease lasts ``lease`` plus ``scaled_lease_intervals`` times what
the interval grew (``lease_for``). With the defaults a crash is noticed after ~5 s with up to 8
members, ~18 s at 16, ~2.6 min at 100 (62 s renewals), ~3.8 min from 142 members on (90 s
renewals); members: the records that have not left (``present``).
A member that shuts down cleanly writes ``left = True`` and an expired lease, which reaches
the others with the next push instead of after the lease runs out.

``live_members(members, now_ms)`` is a pure function of the replicated records and a time,
so two nodes holding the same (converged) state and evaluating at the same instant agree
exactly; evaluated on different nodes "now", they agree as long as clocks are within
``clock_skew`` of each other — the margin is added on the reading side, so a node whose clock
runs slightly ahead does not evict members early. For a round-scoped decision the trainer
should pass one agreed timestamp (e.g. the round's start) as ``now_ms``. A lease that ends more
than ``lease + max_clock_ahead`` after the reader's clock is no lease at all (a record claiming
to be live until 2036 is not live); ``lease`` there is the longest, a large swarm's.

A record is only a claim: anyone who can write to the run can sign records with throwaway keys.
So a member counts only when it is *verified* (``verified_writers``): it proved itself to us on
a live, authenticated connection (a completed state-sync session on a connection whose peer id
is the writer's key, which the access gate admitted when the run has a secret), or members that
proved themselves to us *vouch* for it — each member lists in its record (``peers``) the peers
that proved themselves to it. Whose word counts (``VouchPolicy``):

- an admin's: a peer the operator named (``admins``), or one this node was told to join
  through — its word alone;
- a newcomer's only peer: while no more than one peer has ever proved itself to us, we take its
  word (a newcomer that knows only its bootstrap peer dials the others it names) — unless the
  run's admins were named explicitly. A node that has had other peers does not fall back on
  one voucher when their leases lapse for a moment;
- otherwise members with *standing*, from ``quorum`` (2) distinct *network origins*: a writer
  counts when members at two origins list it. Standing is a track record: the member has proved
  itself to us without a break (a completed sync session within every lease) for
  ``min_standing_s`` (60 s). A published round hash is no such record — any member can copy
  one it read from the state. An origin is the /24 (IPv4) or /48 (IPv6) prefix of the address
  its live connection to us comes from; a relayed connection has none, so a member reached
  only through a relay vouches only as an admin or our only peer. Where the admins were named
  explicitly (``admins_only``), only admins' vouches count.

So one member — or many identities of one member on one network — cannot make anyone a
member for a node that has other peers, and fresh identities cannot at all.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LeasePolicy:
    heartbeat_interval: float = 1.0
    lease: float = 5.0
    clock_skew: float = 0.5
    max_clock_ahead: float = 10.0  # how far a writer's clock may run ahead of the reader's
    small_swarm: int = 8  # members that renew every heartbeat_interval
    renewals_per_s: float = 1.5  # past small_swarm, each member adds 1 / renewals_per_s s to the interval
    max_heartbeat_interval: float = 90.0
    scaled_lease_intervals: float = 2.5  # a scaled lease: lease + this x what the interval grew

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if self.lease < 2 * self.heartbeat_interval:
            raise ValueError("lease must be at least twice the heartbeat interval")
        if self.clock_skew < 0:
            raise ValueError("clock_skew must be >= 0")
        if self.max_clock_ahead < 0:
            raise ValueError("max_clock_ahead must be >= 0")
        if not self.renewals_per_s > 0 or self.small_swarm < 0:
            raise ValueError("renewals_per_s must be positive and small_swarm >= 0")
        if self.max_heartbeat_interval < self.heartbeat_interval:
            raise ValueError("max_heartbeat_interval must be at least heartbeat_interval")
        if not self.scaled_lease_intervals >= 2:
            raise ValueError("scaled_lease_intervals must be >= 2 (a lease outlasts two renewals)")

    def interval_for(self, members: int) -> float:
        """How often a member renews its lease in a swarm of ``members`` members (module docstring)."""
        grown = max(0, members - self.small_swarm) / self.renewals_per_s
        return min(self.max_heartbeat_interval, self.heartbeat_interval + grown)

    def lease_for(self, members: int) -> float:
        return self.scaled_lease(self.interval_for(members))

    def scaled_lease(self, interval: float) -> float:
        """How long a lease lasts when renewed every ``interval``."""
        return self.lease + self.scaled_lease_intervals * max(0.0, interval - self.heartbeat_interval)

    def lease_expiry_ms(self, now_ms: int, interval: float | None = None) -> int:
        """When a lease renewed at ``now_ms`` by a member renewing every ``interval`` ends."""
        return now_ms + int(self.scaled_lease(interval or self.heartbeat_interval) * 1000)

    @property
    def max_ahead_ms(self) -> int:
        """The furthest a lease may end after the reader's clock: the longest lease and the skew."""
        return int((self.scaled_lease(self.max_heartbeat_interval) + self.max_clock_ahead) * 1000)


def present(members: Mapping[str, Mapping[str, object]]) -> int:
    """How many of the ``members`` records have not left (the swarm's size, as
    ``LeasePolicy.interval_for`` counts it). Not the live ones: a view that lags (a loaded host)
    would count fewer, renew faster, lag more and count fewer still; a crashed member counts
    until it is forgotten (``StateConfig.forget_departed_after_s``)."""
    return sum(record.get("left") is not True for record in members.values())


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
IPV4_ORIGIN_PREFIX = 24
IPV6_ORIGIN_PREFIX = 48


@dataclass(frozen=True, kw_only=True)
class VouchPolicy:
    """Whose vouches make a writer that never proved itself to us a member (module docstring).

    ``quorum``: distinct network origins of members with standing that must list a writer;
    ``min_standing_s``: how long a member must have proved itself to us without a break before
    its vouches count; ``admins_only``: only admins vouch (the run's admins were named)."""

    quorum: int = 2
    min_standing_s: float = 60.0
    admins_only: bool = False

    def __post_init__(self) -> None:
        if type(self.quorum) is not int or self.quorum < 1:
            raise ValueError(f"VouchPolicy quorum must be an int >= 1, got {self.quorum!r}")
        if not self.min_standing_s >= 0:
            raise ValueError(f"VouchPolicy min_standing_s must be >= 0, got {self.min_standing_s!r}")


DEFAULT_VOUCHING = VouchPolicy()


@dataclass(frozen=True)
class Proof:
    """A peer that proved itself to us: the network origin of its connection (None: relayed or
    unknown) and how long it has proved itself without a break."""

    origin: str | None
    standing_s: float


class ProvenPeers:
    """The peers that proved themselves to us (a completed sync session on a live connection):
    when last, since when without a break (their standing), and the network origin of the
    connection — what ``verified_writers`` weighs. At most ``max_peers`` are remembered, the
    longest unheard forgotten first. Times are the caller's (monotonic seconds)."""

    def __init__(self, *, lease_s: float, max_peers: int = 4096) -> None:
        self.lease_s, self.max_peers = lease_s, max_peers
        self._last: dict[str, float] = {}  # peer -> its last completed sync session
        self._since: dict[str, float] = {}  # peer -> start of its unbroken run of proofs
        self._origins: dict[str, str | None] = {}  # peer -> network origin of its last proof

    def __contains__(self, peer: str) -> bool:
        """Whether ``peer`` ever proved itself (and is still remembered)."""
        return peer in self._last

    def __len__(self) -> int:
        return len(self._last)

    def current(self, now: float) -> set[str]:
        """Peers with a completed sync session within the last lease."""
        since = now - self.lease_s
        return {peer for peer, at in list(self._last.items()) if at >= since}  # a copy: threads read it

    def aging(self, peers: Iterable[str], now: float) -> list[str]:
        """Those of ``peers`` whose proof (if any) is older than half a lease: to be renewed."""
        since = now - self.lease_s / 2
        return [peer for peer in peers if self._last.get(peer, -math.inf) < since]

    def proofs(self, now: float) -> dict[str, Proof]:
        return {peer: Proof(self._origins.get(peer), now - self._since.get(peer, now)) for peer in self.current(now)}

    def mark(self, peer: str, origin: str | None, now: float) -> bool:
        """``peer`` completed a session now; True when it had no proof within the last lease."""
        fresh = peer not in self.current(now)
        self._last.pop(peer, None)
        self._last[peer] = now
        if fresh:
            self._since[peer] = now
        self._origins[peer] = origin
        while len(self._last) > self.max_peers:
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._since.pop(oldest, None)
            self._origins.pop(oldest, None)
        return fresh


def network_origin(host: str | None, *, relayed: bool = False) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) prefix that ``host`` — the address a live connection comes
    from, as we observe it — belongs to; None for a relayed connection or no address."""
    if relayed or not host:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    prefix = IPV4_ORIGIN_PREFIX if address.version == 4 else IPV6_ORIGIN_PREFIX
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def vouches(record: Mapping[str, object]) -> list[str]:
    peers = record.get("peers")
    if not isinstance(peers, list):
        return []
    return [p for p in peers if isinstance(p, str) and 0 < len(p) <= 128][:MAX_VOUCHES]


def verified_writers(
    members: Mapping[str, Mapping[str, object]],
    *,
    me: str,
    proven: Mapping[str, Proof],
    now_ms: int,
    admins: Collection[str] = (),
    newcomer: bool = False,
    policy: VouchPolicy = DEFAULT_VOUCHING,
    clock_skew_ms: int = 0,
    max_ahead_ms: int | None = None,
) -> set[str]:
    """Who counts as a member for us: ourselves, the peers ``proven`` to us, and the peers
    whose vouchers ``policy`` accepts among the live members of those (module docstring).
    ``newcomer``: no more than one peer has ever proved itself to us."""
    vouchers = {
        peer: proof for peer, proof in sorted(proven.items())
        if peer != me and peer in members
        and is_live(members[peer], now_ms=now_ms, clock_skew_ms=clock_skew_ms, max_ahead_ms=max_ahead_ms)
    }
    verified = set(proven) | {me}
    take_word = newcomer and not policy.admins_only
    for voucher in vouchers:
        if voucher in admins or take_word:
            verified.update(vouches(members[voucher]))
    if policy.admins_only:
        return verified
    origins: dict[str, set[str]] = {}
    for voucher, proof in vouchers.items():
        if proof.origin is not None and proof.standing_s >= policy.min_standing_s:
            for peer in vouches(members[voucher]):
                origins.setdefault(peer, set()).add(proof.origin)
    return verified | {peer for peer, seen in origins.items() if len(seen) >= policy.quorum}
