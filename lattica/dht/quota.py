"""What a DHT node stores for other peers: quotas per sender, bounds in total, fair eviction (sans-IO).

Theory of operation
-------------------
A Kademlia server stores what peers ask it to: provider records (ADD_PROVIDER: "I hold key K")
and value records (PUT_VALUE). Validation bounds each record; nothing else bounds how many, so
a peer sending fresh keys would grow the node without limit. ``StoreLedger`` keeps account of
every record stored on behalf of another peer as an *entry*: its sender, its cost in bytes (key
and payload plus a fixed allowance for the objects that hold it, see ``ENTRY_OVERHEAD``), and
its age.

- **Per sender**: at most ``max_records_per_sender`` entries and ``max_bytes_per_sender`` bytes.
  A record beyond either is refused. Replacing one of the sender's own entries (a re-announce,
  a newer version) counts the difference only, and makes that entry the sender's newest.
- **In total**: at most ``max_records`` entries and ``max_bytes`` bytes. A record that would
  pass either bound evicts the oldest entry of the sender that holds the most bytes, for as long
  as that sender holds more than the newcomer will hold with the record; otherwise the record is
  refused (and anything evicted for it is put back). A flood spread over many identities thus
  displaces itself, and a sender holding little (an honest member: one provider record per run
  key) is never pushed out by one holding more.
- **Our own records** (this node's provides and puts, values it looked up itself) are not
  entries: they never count and are never evicted.
- **Expiry**: entries leave with their records. The stores report each removal (``release``);
  what the library drops behind their back is reconciled when records are expired.

The ledger decides; the stores (``provider_store.py``, ``value_store.py``) hold the records and
carry out its decisions: each store listens for evictions (``on_evict``) and removes the evicted
records it holds, whichever store's admission evicted them.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

# Python objects around a stored record (dict slots, the record object, parsed addresses), on
# top of its key and payload bytes. Measured with py-libp2p 0.8.1: a provider record with two
# addresses adds 1.0 KiB of resident memory and is charged 1.1 KiB; a 16 KB value record adds
# 17.2 KB and is charged 17.0 KB. So the byte bounds are bounds on memory.
ENTRY_OVERHEAD = 1024

EntryKey = Hashable


def value_entry(key: bytes) -> EntryKey:
    """The entry of the value record under ``key``."""
    return ("value", key)


def provider_entry(key: bytes, provider: str) -> EntryKey:
    """The entry of ``provider``'s record for ``key`` (a key holds one per provider)."""
    return ("provider", key, provider)


def value_cost(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


def provider_cost(key: bytes, provider: bytes, addrs: Iterable[bytes]) -> int:
    """``provider``: its peer id's bytes; ``addrs``: its addresses' bytes."""
    return len(key) + len(provider) + sum(len(a) for a in addrs) + ENTRY_OVERHEAD


@dataclass(frozen=True, kw_only=True)
class StoreLimits:
    """Bounds on what a node stores for others (``docs/reliability.md`` explains the defaults).

    An honest member stores one provider record per run key at the few nodes closest to it;
    the per-sender quota leaves room for content announcements and value records on top.
    """

    max_records: int = 8192
    max_bytes: int = 16 << 20
    max_records_per_sender: int = 64
    max_bytes_per_sender: int = 256 << 10

    def __post_init__(self) -> None:
        for name in ("max_records", "max_bytes", "max_records_per_sender", "max_bytes_per_sender"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"store limit {name} must be an integer >= 1, got {value!r}")
        if self.max_records_per_sender > self.max_records:
            raise ValueError("max_records_per_sender must not exceed max_records")
        if self.max_bytes_per_sender > self.max_bytes:
            raise ValueError("max_bytes_per_sender must not exceed max_bytes")


class Refusal(Enum):
    TOO_LARGE = "too-large"  # one record costs more than a sender's whole quota
    SENDER_QUOTA = "sender-quota"  # the sender holds its quota already
    STORE_FULL = "store-full"  # full, and nobody holds more than the sender would


@dataclass(frozen=True)
class Admission:
    refusal: Refusal | None
    evicted: tuple[EntryKey, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    """What the ledger holds and has done, for ``lattica status`` and the metrics."""

    records: int
    bytes: int
    senders: int
    admitted: int
    evicted: int
    refused: dict[str, int]
    limits: StoreLimits


@dataclass
class _Holdings:
    entries: OrderedDict[EntryKey, int] = field(default_factory=OrderedDict)  # key -> cost, oldest first
    bytes: int = 0


class StoreLedger:
    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self._owner: dict[EntryKey, str] = {}
        self._holdings: dict[str, _Holdings] = {}
        self._largest: list[tuple[int, str]] = []  # lazy max-heap of (-bytes, sender)
        self.bytes = 0
        self.admitted = 0
        self.evicted = 0
        self.refused: Counter[Refusal] = Counter()
        self._evict_listeners: list[Callable[[EntryKey], None]] = []

    def on_evict(self, listener: Callable[[EntryKey], None]) -> None:
        """Call ``listener(entry)`` for every entry evicted from now on."""
        self._evict_listeners.append(listener)

    # -- queries ------------------------------------------------------------------------------
    @property
    def records(self) -> int:
        return len(self._owner)

    def __contains__(self, entry: EntryKey) -> bool:
        return entry in self._owner

    def entries(self) -> list[EntryKey]:
        return list(self._owner)

    def holdings(self, sender: str) -> tuple[int, int]:
        """``(records, bytes)`` stored for ``sender``."""
        held = self._holdings.get(sender)
        return (0, 0) if held is None else (len(held.entries), held.bytes)

    def stats(self) -> StoreStats:
        return StoreStats(
            records=self.records, bytes=self.bytes, senders=len(self._holdings),
            admitted=self.admitted, evicted=self.evicted,
            refused={r.value: self.refused[r] for r in Refusal}, limits=self.limits,
        )

    def check(self, entry: EntryKey, sender: str, cost: int) -> Refusal | None:
        """Whether ``admit`` would refuse this record now; changes nothing."""
        refusal = self._sender_refusal(entry, sender, cost)
        if refusal is not None:
            return refusal
        if not self._over_total(entry, sender, cost):
            return None
        return Refusal.STORE_FULL if self._evictable(entry, sender, cost) is None else None

    # -- changes ------------------------------------------------------------------------------
    def admit(self, entry: EntryKey, sender: str, cost: int) -> Admission:
        """Account for ``sender`` storing ``entry`` at ``cost`` bytes, evicting as needed."""
        refusal = self._sender_refusal(entry, sender, cost)
        if refusal is None:
            evicted, refusal = self._make_room(entry, sender, cost)
        if refusal is not None:
            self.refused[refusal] += 1
            return Admission(refusal)
        self.release(entry)
        self._add(entry, sender, cost)
        self.admitted += 1
        self.evicted += len(evicted)
        for key, _, _ in evicted:
            for listener in self._evict_listeners:
                listener(key)
        return Admission(None, tuple(key for key, _, _ in evicted))

    def release(self, entry: EntryKey) -> bool:
        """Forget ``entry`` (its record was removed or expired); False when it was not held."""
        sender = self._owner.pop(entry, None)
        if sender is None:
            return False
        held = self._holdings[sender]
        self._charge(sender, -held.entries.pop(entry))
        if not held.entries:
            del self._holdings[sender]
        return True

    def drop_sender(self, sender: str) -> int:
        """Evict every entry of ``sender`` (a peer dropped for bad input); the number evicted."""
        held = self._holdings.get(sender)
        entries = list(held.entries) if held is not None else []
        for entry in entries:
            self.release(entry)
            for listener in self._evict_listeners:
                listener(entry)
        return len(entries)

    def reconcile(self, present: Iterable[EntryKey]) -> int:
        """Forget entries whose records are gone; the number forgotten."""
        keep = set(present)
        gone = [entry for entry in self._owner if entry not in keep]
        for entry in gone:
            self.release(entry)
        return len(gone)

    # -- internals ----------------------------------------------------------------------------
    def _sender_refusal(self, entry: EntryKey, sender: str, cost: int) -> Refusal | None:
        lim = self.limits
        if cost > lim.max_bytes_per_sender:
            return Refusal.TOO_LARGE
        records, _ = self.holdings(sender)
        replacing = self._owner.get(entry) == sender
        if not replacing and records + 1 > lim.max_records_per_sender:
            return Refusal.SENDER_QUOTA
        if self._after(entry, sender, cost) > lim.max_bytes_per_sender:
            return Refusal.SENDER_QUOTA
        return None

    def _after(self, entry: EntryKey, sender: str, cost: int) -> int:
        """The bytes ``sender`` holds once ``entry`` is stored at ``cost``."""
        held = self._holdings.get(sender)
        if held is None:
            return cost
        return held.bytes - held.entries.get(entry, 0) + cost

    def _freed_by_replacing(self, entry: EntryKey) -> tuple[int, int]:
        sender = self._owner.get(entry)
        return (0, 0) if sender is None else (1, self._holdings[sender].entries[entry])

    def _over_total(self, entry: EntryKey, sender: str, cost: int) -> bool:
        freed_records, freed_bytes = self._freed_by_replacing(entry)
        return (
            self.records - freed_records + 1 > self.limits.max_records
            or self.bytes - freed_bytes + cost > self.limits.max_bytes
        )

    def _make_room(
        self, entry: EntryKey, sender: str, cost: int
    ) -> tuple[list[tuple[EntryKey, str, int]], Refusal | None]:
        """Evict the largest holders' oldest entries until the record fits (or put them back)."""
        evicted: list[tuple[EntryKey, str, int]] = []
        while self._over_total(entry, sender, cost):
            victim = self._evictable(entry, sender, cost)
            oldest = None if victim is None else next((k for k in self._holdings[victim].entries if k != entry), None)
            if victim is None or oldest is None:
                for key, owner, spent in reversed(evicted):
                    self._add(key, owner, spent, oldest=True)
                return [], Refusal.STORE_FULL
            evicted.append((oldest, victim, self._holdings[victim].entries[oldest]))
            self.release(oldest)
        return evicted, None

    def _evictable(self, entry: EntryKey, sender: str, cost: int) -> str | None:
        """The largest holder, if it holds more than ``sender`` will with the record."""
        victim = self._largest_holder()
        if victim is None or victim == sender or self._holdings[victim].bytes <= self._after(entry, sender, cost):
            return None
        return victim

    def _add(self, entry: EntryKey, sender: str, cost: int, *, oldest: bool = False) -> None:
        held = self._holdings.setdefault(sender, _Holdings())
        held.entries[entry] = cost
        if oldest:
            held.entries.move_to_end(entry, last=False)
        self._owner[entry] = sender
        self._charge(sender, cost)

    def _charge(self, sender: str, delta: int) -> None:
        held = self._holdings[sender]
        held.bytes += delta
        self.bytes += delta
        if held.bytes > 0:
            heapq.heappush(self._largest, (-held.bytes, sender))
        if len(self._largest) > 4 * len(self._holdings) + 64:
            self._largest = [(-h.bytes, s) for s, h in self._holdings.items() if h.bytes > 0]
            heapq.heapify(self._largest)

    def _largest_holder(self) -> str | None:
        """The sender holding the most bytes (ties: the smallest id); stale heap rows are dropped."""
        while self._largest:
            negative, sender = self._largest[0]
            held = self._holdings.get(sender)
            if held is not None and held.bytes == -negative:
                return sender
            heapq.heappop(self._largest)
        return None
