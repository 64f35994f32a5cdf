"""How many dials peer exchange may cause: per reply, per source and per host:port.

Theory of operation (sans-IO). A peer-exchange reply is someone else's word on where other
peers are. Dialing whatever it names would let one member turn the whole swarm into a
connection flood against a third host (64 peer ids × 8 ports of that host per reply, every two
seconds, from every member). The connectivity therefore considers only entries for peers with
a verified membership entry in the replicated state, and ``PxDialBudget`` bounds the addresses
those entries make it dial:

- ``per_reply``: addresses one reply may make us dial;
- ``per_source``: addresses all replies of one peer may make us dial per ``source_window_s``;
- ``per_target_s``: a host:port is dialed because of peer exchange at most once per this
  many seconds, whichever peer id or source named it (a relay address counts as its relay's
  host:port).

Addresses heard this way that no connection confirmed are forgotten after ``heard_ttl_s``
(``PeerBook.forget_unanswered``). Dials of members from their own signed records, the DHT and
the redial of known peers do not go through this budget.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


@dataclass(frozen=True, kw_only=True)
class PxDialLimits:
    per_reply: int = 8
    per_source: int = 32
    source_window_s: float = 60.0
    per_target_s: float = 60.0
    heard_ttl_s: float = 600.0
    max_targets: int = 4096  # host:ports remembered, the oldest forgotten first

    def __post_init__(self) -> None:
        for name in ("per_reply", "per_source", "max_targets"):
            if getattr(self, name) < 0:
                raise ValueError(f"PxDialLimits.{name} must be >= 0")
        for name in ("source_window_s", "per_target_s", "heard_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PxDialLimits.{name} must be positive")


class PxDialBudget:
    def __init__(self, limits: PxDialLimits) -> None:
        self.limits = limits
        self._by_source: dict[str, deque[float]] = {}  # source -> times of the dials it caused
        self._targets: OrderedDict[str, float] = OrderedDict()  # host:port -> last px dial
        self.refused = 0  # addresses not dialed for want of budget

    def plan(self, source: str, entries: list[tuple[str, list[str]]], *, now: float) -> list[tuple[str, list[str]]]:
        """The dials one reply of ``source`` may cause: per peer, the addresses to dial
        (peers left without an address are dropped). Spends the budget."""
        self._expire(now)
        limits = self.limits
        spent = self._by_source.setdefault(source, deque())
        left = min(limits.per_reply, limits.per_source - len(spent))
        plan: list[tuple[str, list[str]]] = []
        for peer_id, addrs in entries:
            chosen: list[str] = []
            for addr in addrs:
                target = target_of(addr)
                if target is None or target in self._targets:
                    continue
                if left <= 0:
                    self.refused += 1
                    continue
                self._targets[target] = now
                spent.append(now)
                left -= 1
                chosen.append(addr)
            if chosen:
                plan.append((peer_id, chosen))
        while len(self._targets) > limits.max_targets:
            self._targets.popitem(last=False)
        if not spent:
            del self._by_source[source]
        return plan

    def _expire(self, now: float) -> None:
        limits = self.limits
        while self._targets and now - next(iter(self._targets.values())) >= limits.per_target_s:
            self._targets.popitem(last=False)
        for source, times in list(self._by_source.items()):
            while times and now - times[0] >= limits.source_window_s:
                times.popleft()
            if not times:
                del self._by_source[source]


def target_of(addr: str) -> str | None:
    """``host:port`` a dial of ``addr`` connects to (its relay's, for a relay address)."""
    parts = addr.split("/")
    for i in range(1, len(parts) - 3):
        if parts[i] in _HOST_PROTOCOLS and parts[i + 2] == "tcp" and parts[i + 3].isdigit():
            return f"{parts[i + 1]}:{parts[i + 3]}"
    return None
