"""StallGuardedCollective: a sync whose data plane stops moving is aborted, one that moves is not."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError
from lattica.train.engine.collective import StallGuardedCollective


class _Wire:
    """A collective whose all-reduce takes ``chunks`` steps of ``every`` s, counting bytes, or
    hangs silently after ``silent_after`` steps (a peer whose link was cut)."""

    peer_id = "me"

    def __init__(self, *, chunks: int, every: float, silent_after: int | None = None) -> None:
        self.chunks, self.every, self.silent_after = chunks, every, silent_after
        self.received = 0
        self.cancelled = False

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        try:
            for chunk in range(self.chunks):
                if self.silent_after is not None and chunk >= self.silent_after:
                    await trio.sleep_forever()
                await trio.sleep(self.every)
                self.received += 1000
        except trio.Cancelled:
            self.cancelled = True
            raise
        return [t * 2 for t in tensors]

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        raise BrokenError("stream broken", peer_id=peer)


def _guard(wire: _Wire, stall_s: float = 5.0) -> StallGuardedCollective:
    return StallGuardedCollective(wire, progress=lambda: wire.received, stall_s=stall_s)


async def test_a_long_transfer_that_keeps_moving_completes(autojump_clock) -> None:
    wire = _Wire(chunks=100, every=1.0)  # 100 s in all, never 5 s without a byte
    result = await _guard(wire).allreduce([torch.ones(2)], group=["me", "b"], tag="t")
    assert torch.equal(result[0], torch.full((2,), 2.0))
    assert trio.current_time() >= 100


async def test_a_silent_member_aborts_the_sync_after_the_stall_time(autojump_clock) -> None:
    wire = _Wire(chunks=10, every=1.0, silent_after=3)
    started = trio.current_time()
    with pytest.raises(PeerUnavailableError, match="no progress"):
        await _guard(wire, stall_s=5.0).allreduce([torch.ones(2)], group=["me", "b"], tag="round/3")
    assert wire.cancelled
    assert 3 + 5 <= trio.current_time() - started <= 3 + 5 + 1


async def test_the_operations_own_failure_surfaces_as_itself(autojump_clock) -> None:
    with pytest.raises(BrokenError):
        await _guard(_Wire(chunks=1, every=1.0)).exchange([torch.ones(1)], peer="b", tag="x")


def test_the_guard_needs_positive_times() -> None:
    with pytest.raises(ValueError, match="positive"):
        StallGuardedCollective(_Wire(chunks=1, every=1.0), progress=lambda: 0, stall_s=0)


async def test_a_member_known_silent_aborts_the_sync_sooner(autojump_clock) -> None:
    wire = _Wire(chunks=10, every=0.5, silent_after=3)  # silent after 1.5 s
    guard = StallGuardedCollective(
        wire, progress=lambda: wire.received, stall_s=5.0, alive=lambda peer: peer != "b", lost_stall_s=1.0
    )
    started = trio.current_time()
    with pytest.raises(PeerUnavailableError, match="1 member"):
        await guard.allreduce([torch.ones(2)], group=["me", "b", "c"], tag="round/3")
    assert wire.cancelled
    assert 1.5 + 1 <= trio.current_time() - started <= 1.5 + 1 + 0.5


async def test_a_silent_member_does_not_cut_a_transfer_that_keeps_moving(autojump_clock) -> None:
    # "b" is silent to us, but bytes keep arriving (others relay): never more than 1 s still
    wire = _Wire(chunks=8, every=0.75)
    guard = StallGuardedCollective(
        wire, progress=lambda: wire.received, stall_s=5.0, alive=lambda peer: peer != "b", lost_stall_s=1.0
    )
    result = await guard.allreduce([torch.ones(2)], group=["me", "b"], tag="round/3")
    assert torch.equal(result[0], torch.full((2,), 2.0))
