"""Settings of the DHT subsystem: one frozen, keyword-only, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

from lattica.dht.quota import ENTRY_OVERHEAD, StoreLimits
from lattica.dht.records import ENVELOPE_OVERHEAD, MAX_KEY_BYTES


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    """How a node takes part in the Kademlia DHT and in run discovery.

    Times are in seconds. ``provider_ttl`` is how long a provider record announced by a peer
    is served after its last announcement; members re-announce every ``reprovide_interval``,
    which must be shorter so that a live member never lapses. ``min_run_peers`` is how many
    run members discovery keeps connected (it connects to all it finds, up to
    ``max_run_peers``).

    ``store`` bounds what the node stores for other peers (``quota.py``): per sender and in
    total, in records and in bytes.
    """

    provider_ttl: float = 30 * 60.0
    reprovide_interval: float = 10 * 60.0
    lookup_interval: float = 60.0
    table_refresh_interval: float = 5 * 60.0
    record_ttl: float = 60 * 60.0
    republish_interval: float = 20 * 60.0
    query_timeout: float = 5.0
    lookup_parallelism: int = 3
    lookup_width: int = 20
    max_run_peers: int = 64
    min_run_peers: int = 8
    max_value_bytes: int = 16 * 1024
    max_message_bytes: int = 64 * 1024
    max_providers_per_response: int = 64
    max_addrs_per_peer: int = 16
    ban_seconds: float = 10 * 60.0
    start_as_server: bool = True
    store: StoreLimits = field(default_factory=StoreLimits)

    def __post_init__(self) -> None:
        for name in (
            "provider_ttl",
            "reprovide_interval",
            "lookup_interval",
            "table_refresh_interval",
            "record_ttl",
            "republish_interval",
            "query_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.ban_seconds < 0:
            raise ValueError(f"ban_seconds must be >= 0, got {self.ban_seconds!r}")
        if self.reprovide_interval >= self.provider_ttl:
            raise ValueError(
                f"reprovide_interval ({self.reprovide_interval}) must be shorter than "
                f"provider_ttl ({self.provider_ttl}), or live members would lapse"
            )
        if self.republish_interval >= self.record_ttl:
            raise ValueError(
                f"republish_interval ({self.republish_interval}) must be shorter than "
                f"record_ttl ({self.record_ttl})"
            )
        for name in (
            "lookup_parallelism",
            "lookup_width",
            "max_run_peers",
            "min_run_peers",
            "max_value_bytes",
            "max_message_bytes",
            "max_providers_per_response",
            "max_addrs_per_peer",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.min_run_peers > self.max_run_peers:
            raise ValueError("min_run_peers must not exceed max_run_peers")
        if self.max_value_bytes + 1024 > self.max_message_bytes:
            raise ValueError("max_message_bytes must leave room for a max-size value")
        largest_record = MAX_KEY_BYTES + self.max_value_bytes + ENVELOPE_OVERHEAD + ENTRY_OVERHEAD
        if self.store.max_bytes_per_sender < largest_record:
            raise ValueError(
                f"store.max_bytes_per_sender ({self.store.max_bytes_per_sender}) must hold one "
                f"max-size record ({largest_record} bytes)"
            )
