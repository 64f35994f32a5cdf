"""Seeded link model: one-way latency per pair of peers and a rate per peer."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """One-way latency uniform in ``[min_latency_s, max_latency_s]`` per pair (the same both
    ways), each peer's rate uniform in ``[min_mbit, max_mbit]``; a transfer runs at the lower
    rate of its two ends."""

    seed: int = 0
    min_latency_s: float = 0.05
    max_latency_s: float = 0.30
    min_mbit: float = 20.0
    max_mbit: float = 200.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_latency_s <= self.max_latency_s:
            raise ValueError("need 0 <= min_latency_s <= max_latency_s")
        if not 0 < self.min_mbit <= self.max_mbit:
            raise ValueError("need 0 < min_mbit <= max_mbit")

    def _uniform(self, *parts: str) -> float:
        digest = hashlib.sha256("\0".join((str(self.seed), *parts)).encode()).digest()
        return random.Random(digest).random()

    def latency_s(self, a: str, b: str) -> float:
        lo, hi = sorted((a, b))
        return self.min_latency_s + (self.max_latency_s - self.min_latency_s) * self._uniform("lat", lo, hi)

    def rate_bytes_s(self, peer: str) -> float:
        mbit = self.min_mbit + (self.max_mbit - self.min_mbit) * self._uniform("rate", peer)
        return mbit * 1e6 / 8

    def transfer_s(self, a: str, b: str, nbytes: int) -> float:
        """One message of ``nbytes`` from ``a`` to ``b``: latency plus serialization."""
        return self.latency_s(a, b) + nbytes / min(self.rate_bytes_s(a), self.rate_bytes_s(b))
