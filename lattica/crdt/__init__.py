"""Replicated run state: per-writer pycrdt documents, signed, synced by anti-entropy, durable.

Public entry points: ``ReplicatedState`` (the service) and ``StateConfig``; the sans-IO core
is ``Replica``. See docs/replicated-state.md.
"""


from lattica.crdt.config import ReplicaLimits, StateConfig
from lattica.crdt.envelope import Envelope, RejectedUpdate
from lattica.crdt.liveness import LeasePolicy, live_members
from lattica.crdt.replica import Replica
from lattica.crdt.state import ReplicatedState

__all__ = [
    "Envelope",
    "LeasePolicy",
    "RejectedUpdate",
    "Replica",
    "ReplicaLimits",
    "ReplicatedState",
    "StateConfig",
    "live_members",
]
