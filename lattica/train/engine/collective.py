"""The one seam between outer-step math and the network.

Outer strategies (DiLoCo, NoLoCo, Streaming DiLoCo, SPES) never touch sockets: they call a
``Collective``. The data plane implements it over real peers; ``lattica_lab.collective`` implements it
in memory, so the same strategy code is tested both ways.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import torch
import trio

from lattica.errors import PeerUnavailableError


class Collective(Protocol):
    """Communication primitives over the peers of one outer round.

    ``group`` lists peer ids (strings) *including this node*, in the same order on every member.
    ``tag`` names the operation uniquely within the run (e.g. ``"diloco/round/12"``) so that
    concurrent or late messages never mix. Deadlines come from the caller's trio cancel scope.
    """

    @property
    def peer_id(self) -> str: ...

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        """Return the element-wise mean over ``group`` of each tensor (fp32 accumulation)."""
        ...

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        """Send ``tensors`` to ``peer`` and return the tensors it sent under the same tag."""
        ...


class StallGuardedCollective:
    """A ``Collective`` whose operations are aborted when the data plane stops making progress.

    A member of a sealed group can vanish silently (its link is cut, its process frozen): no
    connection breaks, so the transfers would wait forever. Every ``poll_s`` the guard reads
    ``progress()`` (bytes received by the data plane); when it has not moved for ``stall_s``
    while an operation is in flight, the operation is cancelled and ``PeerUnavailableError`` is
    raised, which every strategy treats as a failed sync (retry with a fresh group, or skip).
    A large transfer that keeps moving is never cut short, however long it takes.

    With ``alive`` (peer id -> whether it is still heard: connected, heartbeat arriving), a stall
    of only ``lost_stall_s`` is enough when a member of the operation is known silent: there is
    nothing to wait for, and the retry starts that much sooner.
    """

    def __init__(
        self, inner: Collective, *, progress: Callable[[], int], stall_s: float, poll_s: float = 0.25,
        alive: Callable[[str], bool] | None = None, lost_stall_s: float = 1.0,
    ) -> None:
        if stall_s <= 0 or poll_s <= 0 or lost_stall_s <= 0:
            raise ValueError("StallGuardedCollective stall_s, poll_s and lost_stall_s must be positive")
        self.inner, self.progress, self.stall_s, self.poll_s = inner, progress, stall_s, poll_s
        self.alive, self.lost_stall_s = alive, min(lost_stall_s, stall_s)

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        return await self._guarded(self.inner.allreduce, tensors, members=group, group=group, tag=tag, codec=codec)

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        return await self._guarded(self.inner.exchange, tensors, members=(peer,), peer=peer, tag=tag, codec=codec)

    async def _guarded(
        self, op: Callable[..., Awaitable[list[torch.Tensor]]], /, *args: object, members: Sequence[str],
        **kwargs: object,
    ) -> list[torch.Tensor]:
        result: list[torch.Tensor] | None = None
        others = [p for p in members if p != self.peer_id]
        why: list[str] = []  # per operation: eager and Streaming syncs overlap
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._cancel_when_stalled, nursery.cancel_scope, others, why)
                result = await op(*args, **kwargs)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the operation's own failure, as itself
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        if result is None:
            raise PeerUnavailableError(f"collective {kwargs['tag']!r} made no progress ({''.join(why)})")
        return result

    async def _cancel_when_stalled(self, scope: trio.CancelScope, others: Sequence[str], why: list[str]) -> None:
        seen, since = self.progress(), trio.current_time()
        while True:
            await trio.sleep(self.poll_s)
            now = self.progress()
            if now != seen:
                seen, since = now, trio.current_time()
            stalled = trio.current_time() - since
            if stalled >= self.stall_s:
                why.append(f"for {self.stall_s:g} s")
                break
            if stalled >= self.lost_stall_s and self.alive is not None:
                lost = [p for p in others if not self.alive(p)]
                if lost:
                    why.append(f"for {stalled:.1f} s, {len(lost)} member(s) silent")
                    break
        scope.cancel()
