"""Received tensor messages waiting for their consumer, keyed by ``(tag, sender, part)``.

Peers reach a collective at different moments, so a part may arrive before the local side asks
for it. It waits here, its bytes still counted in the ``MemoryBudget``, until ``take`` hands it
over (and releases the bytes), until it expires (``ttl``), or until its tag is discarded. A
second message for a key already held is a protocol violation by the sender.

``take`` never waits blindly: it re-checks the sender's liveness whenever the service reports a
lost peer and at least every ``poll_s``, so a dead sender becomes ``PeerUnavailableError``
instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from lattica.errors import PeerUnavailableError
from lattica.net.tensors.limits import MemoryBudget
from lattica.numerics.codecs import TensorSpec

Key = tuple[str, str, int]


@dataclass(slots=True)
class Parcel:
    specs: tuple[TensorSpec, ...]
    payload: bytearray | memoryview
    received_at: float


class Mailbox:
    def __init__(self, budget: MemoryBudget, *, ttl_s: float, poll_s: float = 0.25) -> None:
        self._budget = budget
        self._ttl_s = ttl_s
        self._poll_s = poll_s
        self._parcels: dict[Key, Parcel] = {}
        self._arrived: dict[Key, trio.Event] = {}
        self._posted: dict[Key, memoryview] = {}
        self._progress: dict[Key, Callable[[int], None]] = {}  # posted buffers' fill watchers
        self._claimed: dict[Key, bool] = {}  # posted buffers being written: key -> withdrawn

    def __len__(self) -> int:
        return len(self._parcels)

    def deliver(
        self, key: Key, specs: tuple[TensorSpec, ...], payload: bytearray | memoryview
    ) -> bool:
        """Store a fully received message whose bytes are reserved; False on a duplicate key."""
        self._expire()
        if key in self._parcels:
            self._budget.release(key[1], len(payload))
            return False
        self._parcels[key] = Parcel(specs, payload, trio.current_time())
        self._wake(key)
        return True

    async def take(self, key: Key, *, alive: Callable[[str], bool]) -> Parcel:
        sender = key[1]
        while True:
            parcel = self._parcels.pop(key, None)
            if parcel is not None:
                self._budget.release(sender, len(parcel.payload))
                return parcel
            if not alive(sender):
                raise PeerUnavailableError("peer left before sending its part", peer_id=sender)
            event = self._arrived.setdefault(key, trio.Event())
            with trio.move_on_after(self._poll_s):
                await event.wait()
            if self._arrived.get(key) is event and event.is_set():
                del self._arrived[key]

    def post(self, key: Key, buffer: memoryview, on_progress: Callable[[int], None] | None = None) -> None:
        """Offer ``buffer`` as the destination of the payload of ``key`` if it arrives later
        with exactly that size (a receive that lands in place, with no copy). ``on_progress``
        is told how many of its first bytes are written (authenticated, on the fast path)
        while the message arrives, until the message is complete or the offer withdrawn."""
        self._posted[key] = buffer
        if on_progress is not None:
            self._progress[key] = on_progress

    def unpost(self, key: Key) -> None:
        """Withdraw the offer. If a message is already being written into the buffer, the
        writer sees ``revoked(key)`` before its next write and drops the rest of it."""
        self._posted.pop(key, None)
        self._progress.pop(key, None)
        if key in self._claimed:
            self._claimed[key] = True

    def claim_posted(self, key: Key, nbytes: int) -> memoryview | None:
        buffer = self._posted.get(key)
        if buffer is None or len(buffer) != nbytes:
            return None
        del self._posted[key]
        self._claimed[key] = False
        return buffer

    def revoked(self, key: Key) -> bool:
        return self._claimed.get(key, False)

    def written(self, key: Key, nbytes: int) -> None:
        """The writer of a claimed buffer has filled its first ``nbytes``."""
        watcher = self._progress.get(key)
        if watcher is not None and self._claimed.get(key) is False:
            watcher(nbytes)

    def end_claim(self, key: Key) -> None:
        """The writer of a claimed buffer is done with it (complete, dropped or broken)."""
        self._claimed.pop(key, None)
        self._progress.pop(key, None)

    def peer_lost(self, peer: str) -> None:
        """Wake everyone waiting on ``peer`` so they re-check its liveness now."""
        for key in [k for k in self._arrived if k[1] == peer]:
            self._wake(key)

    def discard(self, predicate: Callable[[Key], bool]) -> int:
        keys = [k for k in self._parcels if predicate(k)]
        for key in keys:
            self._budget.release(key[1], len(self._parcels.pop(key).payload))
        return len(keys)

    def _wake(self, key: Key) -> None:
        event = self._arrived.pop(key, None)
        if event is not None:
            event.set()

    def _expire(self) -> None:
        deadline = trio.current_time() - self._ttl_s
        self.discard(lambda k: self._parcels[k].received_at < deadline)
