"""Memory and concurrency limits for tensors in flight, their accounting, and scratch buffers.

Every incoming payload is sized from its header and reserved here *before* a byte of it is
stored. A reservation fails when it would exceed the message cap, the peer's share, the peer's
number of concurrent transfers, or the node-wide total; the message is then skipped (its bytes
are read and dropped, so the stream stays usable) and counted as refused.

A ``fetch`` request is a few bytes that make us send every tensor it names, so answering is
rationed too (``FetchGate``): a peer has at most ``max_peer_fetch_serves`` answers in flight and
gets the same content (the same served tensors) at most once per ``fetch_repeat_s``; the node
sends at most ``max_fetch_serves`` answers at once (the others wait their turn). Identities are
free, so the node as a whole also has a budget (``ServingBudget``): at most ``max_fetch_answers``
answers in flight (sending or waiting), and bytes at ``fetch_serve_bytes_per_s`` with bursts of
``fetch_serve_burst_bytes``. A request over a peer's share or over the node's budget is answered
with no tensors (the fetcher sees "does not serve … or is busy" and tries another holder or
later); while a few such refusals are still on their way to the peer, more requests are dropped
unanswered, so a flood costs the flooder's bandwidth, not ours.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import torch

from lattica.net.serving_budget import ServingBudget, ServingLimits


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorLimits:
    max_message_bytes: int = 2 << 30
    max_total_bytes: int = 6 << 30
    max_peer_bytes: int = 3 << 30
    max_peer_transfers: int = 16
    max_header_bytes: int = 4 << 20
    mailbox_ttl_s: float = 600.0
    scratch_pool_bytes: int = 512 << 20
    max_peer_fetch_serves: int = 2
    max_fetch_serves: int = 8
    fetch_repeat_s: float = 5.0
    max_fetch_answers: int = 32
    fetch_serve_bytes_per_s: float = 32 << 20
    fetch_serve_burst_bytes: int = 256 << 20

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
        if not 1 <= self.max_peer_fetch_serves <= self.max_fetch_serves:
            raise ValueError("max_peer_fetch_serves must be between 1 and max_fetch_serves")
        if not 0 <= self.fetch_repeat_s < float("inf"):
            raise ValueError("fetch_repeat_s must be a finite number of seconds, at least 0")
        if self.max_fetch_answers < self.max_fetch_serves:
            raise ValueError("max_fetch_answers must be at least max_fetch_serves")
        self.fetch_serving()  # validates the serving budget's settings

    def fetch_serving(self) -> ServingLimits:
        """The node-wide budget for fetch answers."""
        return ServingLimits(
            bytes_per_s=self.fetch_serve_bytes_per_s, burst_bytes=self.fetch_serve_burst_bytes,
            max_answers=self.max_fetch_answers,
        )


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


class FetchAnswer(Enum):
    SERVE = "serve"  # send the named tensors
    REFUSE = "refuse"  # answer with no tensors
    DROP = "drop"  # do not answer


_MAX_RECENT_PER_PEER = 64
_MAX_REFUSALS_IN_FLIGHT = 4  # per peer; more requests meanwhile go unanswered


class FetchGate:
    """Decides how a ``fetch`` request is answered; sans-IO (the caller passes the clock).

    ``content`` identifies what would be sent (the names and versions of the served tensors),
    ``nbytes`` its size; an empty one is cheap to answer and only counted as a refusal. Every
    ``SERVE`` and ``REFUSE`` must be followed by ``done`` once the answer went out (or failed).
    """

    def __init__(self, limits: TensorLimits) -> None:
        self.limits = limits
        self.budget = ServingBudget(limits.fetch_serving())
        self.serving: Counter[str] = Counter()
        self.refusing: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # requests refused or dropped, per peer
        # per peer, content -> when last sent, oldest first; peers in order of their last send
        self._recent: OrderedDict[str, OrderedDict[Hashable, float]] = OrderedDict()

    def request(self, peer: str, content: tuple[Hashable, ...], now: float, *, nbytes: int = 0) -> FetchAnswer:
        self._forget_before(now - self.limits.fetch_repeat_s)
        answer = self._decide(peer, content, now, nbytes)
        if answer is FetchAnswer.SERVE:
            self.serving[peer] += 1
            self._remember(peer, content, now)
        elif answer is FetchAnswer.REFUSE:
            self.refusing[peer] += 1
        if content and answer is not FetchAnswer.SERVE:
            self.refused[peer] += 1
        return answer

    def done(self, peer: str, answer: FetchAnswer, content: tuple[Hashable, ...], now: float) -> None:
        counter = self.serving if answer is FetchAnswer.SERVE else self.refusing
        counter[peer] -= 1
        if counter[peer] <= 0:
            del counter[peer]
        if answer is FetchAnswer.SERVE:
            self.budget.done()
            self._remember(peer, content, now)  # the interval counts from the end of a send

    def _decide(self, peer: str, content: tuple[Hashable, ...], now: float, nbytes: int) -> FetchAnswer:
        within_share = content and self.serving[peer] < self.limits.max_peer_fetch_serves
        if within_share and not self._repeated(peer, content, now) and self.budget.try_start(now):
            self.budget.try_take(nbytes, now)  # holds tokens: try_start just saw them
            return FetchAnswer.SERVE
        return FetchAnswer.DROP if self.refusing[peer] >= _MAX_REFUSALS_IN_FLIGHT else FetchAnswer.REFUSE

    def _repeated(self, peer: str, content: tuple[Hashable, ...], now: float) -> bool:
        recent = self._recent.get(peer)
        if recent is None:
            return False
        while recent and now - next(iter(recent.values())) >= self.limits.fetch_repeat_s:
            recent.popitem(last=False)
        # a peer asking for many different subsets in a short time is treated as repeating itself
        return content in recent or len(recent) >= _MAX_RECENT_PER_PEER

    def _remember(self, peer: str, content: tuple[Hashable, ...], now: float) -> None:
        if self.limits.fetch_repeat_s <= 0:
            return
        recent = self._recent.setdefault(peer, OrderedDict())
        recent[content] = now
        recent.move_to_end(content)
        self._recent.move_to_end(peer)

    def _forget_before(self, cutoff: float) -> None:
        """Forget peers whose last send is older than ``cutoff``: they come first (peers move to
        the end when sent to), so memory stays bounded by what was sent recently."""
        while self._recent:
            peer, recent = next(iter(self._recent.items()))
            if recent and next(reversed(recent.values())) > cutoff:
                break
            del self._recent[peer]


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
