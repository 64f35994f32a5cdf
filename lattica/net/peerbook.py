"""What this node knows about other peers: addresses, connection state, path and RTT.

A pure bookkeeping object, updated by the daemon's connection watcher, peer exchange and
goodbye handler, and read by ``lattica peers``. Times come from the caller (``now``) so it is
tested without a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_ADDRS_PER_PEER = 16
MAX_CIRCUITS_PER_PEER = 4
MAX_KNOWN_PEERS = 4096


@dataclass
class PeerRecord:
    peer_id: str
    addrs: list[str] = field(default_factory=list)
    connected: bool = False
    first_seen: float = 0.0
    last_change: float = 0.0
    left: bool = False
    path: str = "unknown"
    relay: str | None = None  # the relay's peer id while the path is "relayed"
    rtt_ms: float | None = None
    bootstrap: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "addrs": list(self.addrs),
            "connected": self.connected,
            "left": self.left,
            "path": self.path if self.connected else None,
            "relay": self.relay if self.connected else None,
            "rtt_ms": self.rtt_ms if self.connected else None,
            "bootstrap": self.bootstrap,
            "since": self.last_change,
        }


class PeerBook:
    def __init__(self, self_id: str) -> None:
        self.self_id = self_id
        self._peers: dict[str, PeerRecord] = {}

    def get(self, peer_id: str) -> PeerRecord | None:
        return self._peers.get(peer_id)

    def learn(self, peer_id: str, addrs: list[str], *, now: float, bootstrap: bool = False) -> PeerRecord | None:
        """Record addresses heard for ``peer_id``; returns None for self or when full.

        Direct addresses accumulate. Relay (``/p2p-circuit``) addresses are replaced as a set
        whenever some are heard: a peer's reservations move when a relay goes away, and a
        dead relay's address must not linger in front of the live one.
        """
        if peer_id == self.self_id:
            return None
        record = self._peers.get(peer_id)
        if record is None:
            if len(self._peers) >= MAX_KNOWN_PEERS:
                return None
            record = self._peers[peer_id] = PeerRecord(peer_id, first_seen=now, last_change=now)
        direct = [a for a in record.addrs if not _is_circuit(a)]
        circuits = [a for a in record.addrs if _is_circuit(a)]
        heard_circuits = list(dict.fromkeys(a for a in addrs if _is_circuit(a)))
        if heard_circuits:
            circuits = heard_circuits[:MAX_CIRCUITS_PER_PEER]
        for addr in addrs:
            if not _is_circuit(addr) and addr not in direct and len(direct) < MAX_ADDRS_PER_PEER:
                direct.append(addr)
        record.addrs = direct + circuits
        record.bootstrap = record.bootstrap or bootstrap
        return record

    def set_connected(self, connected_ids: set[str], *, now: float) -> tuple[list[str], list[str]]:
        """Sync with the host's connected set; returns (newly connected, newly disconnected)."""
        joined, gone = [], []
        for peer_id in connected_ids:
            record = self.learn(peer_id, [], now=now)
            if record is not None and not record.connected:
                record.connected, record.left, record.last_change = True, False, now
                joined.append(peer_id)
        for record in self._peers.values():
            if record.connected and record.peer_id not in connected_ids:
                record.connected, record.last_change = False, now
                gone.append(record.peer_id)
        return joined, gone

    def mark_left(self, peer_id: str, *, now: float) -> None:
        record = self._peers.get(peer_id)
        if record is not None:
            record.left, record.last_change = True, now

    def records(self) -> list[PeerRecord]:
        return sorted(self._peers.values(), key=lambda r: r.peer_id)

    def connected_ids(self) -> list[str]:
        return [r.peer_id for r in self.records() if r.connected]


def _is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr
