"""Traffic counters of the data plane, per peer and per path (``"fast"`` or ``"libp2p"``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# smaller messages sit in socket buffers: their send time says nothing about the link
TIMED_TRANSFER_BYTES = 64 * 1024


@dataclass
class TrafficStats:
    bytes_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes_received: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages_received: Counter[tuple[str, str]] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    protocol_errors: Counter[str] = field(default_factory=Counter)
    rejected_contributions: Counter[str] = field(default_factory=Counter)
    # peer -> (bytes, seconds) of the last message large enough to time a transfer by
    last_sent: dict[str, tuple[int, float]] = field(default_factory=dict)

    def note_transfer(self, peer: str, size: int, seconds: float) -> None:
        if size >= TIMED_TRANSFER_BYTES and seconds > 0:
            self.last_sent[peer] = (size, seconds)

    def sent_to(self, peer: str) -> int:
        return sum(n for (p, _), n in self.bytes_sent.items() if p == peer)

    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    def total_received(self) -> int:
        return sum(self.bytes_received.values())

    def snapshot(self) -> dict[str, dict[str, dict[str, int]] | dict[str, int]]:
        """Plain nested dicts, ready for a metrics exporter or JSON."""

        def nest(counter: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for (peer, path), n in counter.items():
                out.setdefault(peer, {})[path] = n
            return out

        return {
            "bytes_sent": nest(self.bytes_sent),
            "bytes_received": nest(self.bytes_received),
            "messages_sent": nest(self.messages_sent),
            "messages_received": nest(self.messages_received),
            "refused": dict(self.refused),
            "protocol_errors": dict(self.protocol_errors),
            "rejected_contributions": dict(self.rejected_contributions),
        }
