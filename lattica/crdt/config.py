"""Settings of the replicated state: the replica's limits and the service's."""

from __future__ import annotations

from dataclasses import dataclass, field

from lattica.crdt.liveness import LeasePolicy, VouchPolicy
from lattica.crdt.sync_plan import SyncPolicy
from lattica.net.serving_budget import ServingLimits


@dataclass(frozen=True, kw_only=True)
class ReplicaLimits:
    max_update_bytes: int = 64 * 1024
    max_snapshot_bytes: int = 1024 * 1024
    max_stream_bytes: int = 4 * 1024 * 1024
    max_streams: int = 4096
    max_pending_per_stream: int = 64
    max_pending_total: int = 1024
    pending_ttl: float = 30.0  # seconds an early arrival waits for its predecessors
    max_banned: int = 1024  # equivocating writers remembered (each needs two signed envelopes)
    snapshot_every: int = 128

    def __post_init__(self) -> None:
        for name in ("max_update_bytes", "max_snapshot_bytes", "max_stream_bytes", "max_streams"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_snapshot_bytes < self.max_update_bytes:
            raise ValueError("max_snapshot_bytes must be >= max_update_bytes")
        if self.max_stream_bytes < self.max_snapshot_bytes:
            raise ValueError("max_stream_bytes must be >= max_snapshot_bytes")
        if self.max_pending_per_stream < 0 or self.max_pending_total < 0:
            raise ValueError("pending buffer sizes must be >= 0")
        if not self.pending_ttl > 0:
            raise ValueError("pending_ttl must be positive")
        if self.max_banned < 1:
            raise ValueError("max_banned must be >= 1")
        if self.snapshot_every < 2:
            raise ValueError("snapshot_every must be >= 2")


def default_serving() -> ServingLimits:
    """What the node sends in state-sync answers, all peers together: a joiner's full state is
    typically well under 1 MiB, a repair session a state vector of a few KiB."""
    return ServingLimits(bytes_per_s=8 << 20, burst_bytes=64 << 20, max_answers=64)


@dataclass(frozen=True, kw_only=True)
class StateConfig:
    """Who may write the run config. ``admins``: exactly these peer ids. Without them the
    admins follow from the run (``Replica``'s ``admin_relays``): whoever's run config reached
    this node through ``anchors`` (the peers it joined through), an admin, or its own state
    log; a node with neither such a record nor anchors founds a run and is its admin.
    ``vouching``: whose word makes a peer that never connected to us a member.
    ``serving``: the node-wide budget for answering state-sync sessions (``sync.py``).
    ``forget_departed_after_s``: a member whose lease ended this long ago is dropped from the
    state (``Replica.forget_departed``). ``plan``: how many peers a change is pushed to per
    ``sync_interval`` and how often a full repair session runs (``sync_plan``)."""

    admins: tuple[str, ...] = ()
    anchors: tuple[str, ...] = ()
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    vouching: VouchPolicy = field(default_factory=VouchPolicy)
    limits: ReplicaLimits = field(default_factory=ReplicaLimits)
    sync_interval: float = 1.0
    peer_poll_interval: float = 0.5
    sync_timeout: float = 10.0
    max_backoff: float = 30.0
    compact_min_records: int = 1024
    forget_departed_after_s: float = 600.0
    serving: ServingLimits = field(default_factory=default_serving)
    plan: SyncPolicy = field(default_factory=SyncPolicy)

    def __post_init__(self) -> None:
        for name in ("admins", "anchors"):
            peers = getattr(self, name)
            if isinstance(peers, str) or not all(isinstance(a, str) and a for a in peers):
                raise ValueError(f"{name} must be a tuple of peer id strings")
        for name in ("sync_interval", "peer_poll_interval", "sync_timeout", "max_backoff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.forget_departed_after_s >= self.lease.lease:
            raise ValueError("forget_departed_after_s must be at least the lease")
        if self.compact_min_records < 1:
            raise ValueError("compact_min_records must be >= 1")
