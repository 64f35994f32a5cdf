"""Helpers shared by the replicated-state tests."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from lattica.crdt.replica import Replica, ReplicaLimits

RUN = "run-test"


def peer_of(key_pair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


def make_replicas(
    n: int, *, admin_count: int = 1, limits: ReplicaLimits | None = None, seeded: bool = False
):
    """``seeded``: fixed keys, so that peer ids (and with them iteration orders) repeat."""
    keys = [create_new_key_pair(bytes([i + 1]) * 32 if seeded else None) for i in range(n)]
    admins = [peer_of(k) for k in keys[:admin_count]]
    return [Replica(run_id=RUN, key_pair=k, admins=admins, limits=limits) for k in keys]
