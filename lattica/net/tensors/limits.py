"""Memory and concurrency limits for tensors in flight, their accounting, and scratch buffers.

Every incoming payload is sized from its header and reserved here *before* a byte of it is
stored. A reservation fails when it would exceed the message cap, the peer's share, the peer's
number of concurrent transfers, or the node-wide total; the message is then skipped (its bytes
are read and dropped, so the stream stays usable) and counted as refused.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorLimits:
    max_message_bytes: int = 2 << 30
    max_total_bytes: int = 6 << 30
    max_peer_bytes: int = 3 << 30
    max_peer_transfers: int = 16
    max_header_bytes: int = 4 << 20
    mailbox_ttl_s: float = 600.0
    scratch_pool_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_total_bytes", "max_peer_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_peer_transfers < 1:
            raise ValueError("max_peer_transfers must be at least 1")
        if not 1024 <= self.max_header_bytes <= 64 << 20:
            raise ValueError("max_header_bytes must be between 1 KiB and 64 MiB")
        if self.max_peer_bytes > self.max_total_bytes:
            raise ValueError("max_peer_bytes cannot exceed max_total_bytes")
        if self.mailbox_ttl_s <= 0:
            raise ValueError("mailbox_ttl_s must be positive")
        if self.scratch_pool_bytes < 0:
            raise ValueError("scratch_pool_bytes cannot be negative")


class MemoryBudget:
    """Bytes and transfer slots held per peer, against ``TensorLimits``."""

    def __init__(self, limits: TensorLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_peer: dict[str, int] = defaultdict(int)
        self.transfers: dict[str, int] = defaultdict(int)

    def try_reserve(self, peer: str, nbytes: int) -> str | None:
        """Reserve ``nbytes`` and one transfer slot; return None, or why it was refused."""
        lim = self.limits
        if nbytes > lim.max_message_bytes:
            return f"message of {nbytes} bytes exceeds the {lim.max_message_bytes}-byte cap"
        if self.transfers[peer] >= lim.max_peer_transfers:
            return "too many concurrent transfers from this peer"
        if self.per_peer[peer] + nbytes > lim.max_peer_bytes:
            return "peer's share of buffer memory exhausted"
        if self.total + nbytes > lim.max_total_bytes:
            return "buffer memory exhausted"
        self.total += nbytes
        self.per_peer[peer] += nbytes
        self.transfers[peer] += 1
        return None

    def end_transfer(self, peer: str) -> None:
        """The payload is fully received; its bytes stay reserved until ``release``."""
        self.transfers[peer] = max(0, self.transfers[peer] - 1)

    def release(self, peer: str, nbytes: int) -> None:
        self.total -= nbytes
        self.per_peer[peer] -= nbytes
        if not self.per_peer[peer]:
            del self.per_peer[peer]


class ScratchPool:
    """Receive buffers kept between collectives of the same size.

    Writing into freshly mapped memory costs a page fault per 4 KiB, which on a busy host is
    slower than the AES-GCM that fills it. A buffer goes back to the pool only when its lease
    ends normally: after an abort a late sender might still be writing into it, so it is dropped.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pooled_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)

    @contextmanager
    def lease(self, nbytes: int) -> Iterator[torch.Tensor]:
        free = self._free.get(nbytes)
        if free:
            buffer = free.pop()
            self.pooled_bytes -= nbytes
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        yield buffer  # not in a try/finally on purpose: an exception drops the buffer
        if self.pooled_bytes + nbytes <= self.max_bytes:
            self._free[nbytes].append(buffer)
            self.pooled_bytes += nbytes
