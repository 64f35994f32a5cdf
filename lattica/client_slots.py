"""Bounded client slots for the local servers (control socket, metrics exporter).

A server takes a slot per connection. When every slot is busy, the client that has waited
longest for its request (it connected but is still sending, or trickling, its first bytes) gives
way to the new one: clients that read slowly on purpose cannot keep a real request out.
A client whose request has arrived is served to the end; only when every slot holds such a
client is the newcomer turned away.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class ClientSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the client limit must be >= 1, got {limit}")
        self.limit = limit
        self.busy = 0
        self._reading: dict[object, trio.CancelScope] = {}  # oldest first

    def take(self) -> bool:
        """Take a slot, displacing the oldest client still owing its request; False if none."""
        if self.busy >= self.limit and not self._displace_oldest():
            return False
        self.busy += 1
        return True

    def give_back(self) -> None:
        self.busy -= 1

    @contextmanager
    def reading(self, scope: trio.CancelScope) -> Iterator[None]:
        """While inside, the client is still sending its request: a newcomer may cancel ``scope``."""
        key = object()
        self._reading[key] = scope
        try:
            yield
        finally:
            self._reading.pop(key, None)

    def _displace_oldest(self) -> bool:
        for key, scope in self._reading.items():
            del self._reading[key]
            scope.cancel()
            return True
        return False
