"""What this node knows about other peers: addresses, connection state, path and RTT.

A pure bookkeeping object, updated by the daemon's connection watcher, peer exchange and
goodbye handler, and read by ``lattica peers``. Times come from the caller (``now``) so it is
tested without a clock.

Addresses come in two kinds. ``addrs`` are the ones a peer vouches for itself or that we were
told by the user: ``--peer``, identify, its signed member record, the book saved by our previous
life. ``heard`` are the ones a third party named in peer exchange: they may be made up (a member
could list another host's ports under a real member's id), so they are dialed only within the
peer-exchange budgets (``px_dials``), never passed on to others nor saved, and forgotten after
``heard_ttl`` unless the peer itself confirms them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ADDRS_PER_PEER = 16
MAX_CIRCUITS_PER_PEER = 4
MAX_HEARD_PER_PEER = 8
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
    last_connected: float = 0.0  # when we last saw it connected (0: never)
    member: bool = False  # it spoke a Lattica protocol on a connection (not a plain relay or DHT node)
    heard: dict[str, float] = field(default_factory=dict)  # px address -> when first heard

    def as_json(self) -> dict[str, object]:
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
        """Record addresses of ``peer_id`` that it vouches for itself (or the user gave);
        returns None for self or when full.

        Direct addresses accumulate. Relay (``/p2p-circuit``) addresses are replaced as a set
        whenever some are heard: a peer's reservations move when a relay goes away, and a
        dead relay's address must not linger in front of the live one.
        """
        record = self._record(peer_id, now=now)
        if record is None:
            return None
        direct = [a for a in record.addrs if not _is_circuit(a)]
        circuits = [a for a in record.addrs if _is_circuit(a)]
        heard_circuits = list(dict.fromkeys(a for a in addrs if _is_circuit(a)))
        if heard_circuits:
            circuits = heard_circuits[:MAX_CIRCUITS_PER_PEER]
        for addr in addrs:
            if not _is_circuit(addr) and addr not in direct and len(direct) < MAX_ADDRS_PER_PEER:
                direct.append(addr)
        record.addrs = direct + circuits
        for addr in addrs:
            record.heard.pop(addr, None)  # confirmed
        record.bootstrap = record.bootstrap or bootstrap
        return record

    def learn_reported(self, peer_id: str, addrs: list[str], *, now: float) -> PeerRecord | None:
        """Addresses the host holds for a connected peer: what its identify said, but also
        what we dialed it at — so a heard address among them confirms nothing."""
        record = self._peers.get(peer_id)
        heard = record.heard if record is not None else {}
        return self.learn(peer_id, [a for a in addrs if a not in heard], now=now)

    def hear(self, peer_id: str, addrs: list[str], *, now: float) -> PeerRecord | None:
        """Addresses of ``peer_id`` that a third party named (peer exchange): unconfirmed."""
        record = self._record(peer_id, now=now)
        if record is None:
            return None
        for addr in addrs:
            if addr not in record.addrs and addr not in record.heard and len(record.heard) < MAX_HEARD_PER_PEER:
                record.heard[addr] = now
        return record

    def forget_unanswered(self, *, now: float, heard_ttl: float) -> None:
        """Drop heard addresses older than ``heard_ttl``, and peers we know nothing else of."""
        for peer_id, record in list(self._peers.items()):
            record.heard = {a: at for a, at in record.heard.items() if now - at < heard_ttl}
            if not (record.addrs or record.heard or record.connected or record.last_connected or record.bootstrap):
                del self._peers[peer_id]

    def remember(
        self, peer_id: str, addrs: list[str], *, last_connected: float, now: float,
    ) -> PeerRecord | None:
        """A member known from the book saved by this node's previous life."""
        record = self.learn(peer_id, addrs, now=now)
        if record is not None:
            record.member = True
            record.last_connected = max(record.last_connected, last_connected)
        return record

    def set_connected(self, connected_ids: set[str], *, now: float) -> tuple[list[str], list[str]]:
        """Sync with the host's connected set; returns (newly connected, newly disconnected)."""
        joined, gone = [], []
        for peer_id in connected_ids:
            record = self._record(peer_id, now=now)
            if record is None:
                continue
            record.last_connected = now
            if not record.connected:
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

    def _record(self, peer_id: str, *, now: float) -> PeerRecord | None:
        if peer_id == self.self_id:
            return None
        record = self._peers.get(peer_id)
        if record is None:
            if len(self._peers) >= MAX_KNOWN_PEERS:
                return None
            record = self._peers[peer_id] = PeerRecord(peer_id, first_seen=now, last_change=now)
        return record


def _is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr
