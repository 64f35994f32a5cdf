"""All-reduce and pairwise exchange on top of point-to-point tensor messages.

All-reduce (butterfly reduce-scatter + all-gather)
-------------------------------------------------
The tensors are flattened into one fp32 vector and cut into N near-equal parts; part ``i``
belongs to ``group[i]``. Reduce-scatter: every member sends part ``j`` (in the requested codec)
to ``group[j]`` under ``<tag>/rs`` and sums, in fp32 and in group order, the N decoded
contributions to its own part (its own goes through the codec too, so no member is favoured).
All-gather: the owner of part ``i`` sends the mean, again in the codec, to everyone under
``<tag>/ag``, and keeps for itself the *decoded* copy of what it sent — all members therefore
end with bit-identical results. Each member sends ``2 (N-1)/N`` of the encoded payload.

Screening: the owner of a part checks every contribution to it (non-finite values always;
outliers by norm and robust aggregation on request, see ``screen.py``). It decides once, so
every member still ends with the same bits; excluded peers are reported to ``on_reject`` for
scoring. With ``fp32`` and a screen of norms only, the owner sums while the contributions
arrive (``streaming_mean.py``) and decides when all are in, falling back to the exact path.

Failure: if any send fails, any awaited sender disappears or sends something malformed, every
transfer of this collective is cancelled, its leftover parts are discarded, and
``CollectiveAbortedError`` (a ``PeerUnavailableError``) lists the failed peers, so the caller
can retry without them. Deadlines are the caller's cancel scopes. A result is returned only if
every contribution was summed — never a partial average.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Protocol

import numpy as np
import torch
import trio

from lattica.errors import (
    BrokenError,
    LocalProtocolError,
    PeerUnavailableError,
    RemoteProtocolError,
)
from lattica.numerics import codecs
from lattica.numerics.screen import DEFAULT_SCREEN, ContributionScreen, Rejection, only_screens_norms, reduce_parts
from lattica.numerics.streaming_mean import StreamingMean


class CollectiveAbortedError(PeerUnavailableError):
    """A collective could not complete; ``failed_peers`` are the members to leave out."""

    def __init__(self, message: str, *, failed_peers: Sequence[str]) -> None:
        super().__init__(message, peer_id=failed_peers[0] if failed_peers else None)
        self.failed_peers = tuple(failed_peers)

    def __str__(self) -> str:
        return f"{self.args[0]} (failed peers: {', '.join(self.failed_peers)})"


class TensorTransport(Protocol):
    @property
    def peer_id(self) -> str: ...

    async def send(
        self, peer: str, tag: str, tensors: Sequence[torch.Tensor], *, codec: str = "fp32",
        part: int = 0,
    ) -> None: ...

    async def receive(self, peer: str, tag: str, *, part: int = 0) -> list[tuple[str, torch.Tensor]]: ...

    def post_receive(
        self, peer: str, tag: str, part: int, buffer: memoryview | None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None: ...

    def lease_scratch(self, nbytes: int) -> AbstractContextManager[torch.Tensor]: ...

    def discard_tag(self, tag: str) -> None: ...


_PEER_FAILURES = (PeerUnavailableError, BrokenError, RemoteProtocolError)


class _Round:
    """Runs the transfers of one collective phase; the first peer failure cancels them all."""

    def __init__(self, transport: TensorTransport, tag: str) -> None:
        self.transport, self.tag = transport, tag
        self.failed: list[str] = []

    async def guarded(self, peer: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        try:
            await fn(*args)
        except _PEER_FAILURES:
            if peer not in self.failed:
                self.failed.append(peer)
            self.scope.cancel()

    async def run(self, body: Callable[[trio.Nursery], None]) -> None:
        with trio.CancelScope() as self.scope:
            async with trio.open_nursery() as nursery:
                body(nursery)
        if self.failed:
            self.transport.discard_tag(self.tag)
            raise CollectiveAbortedError(f"collective {self.tag!r} aborted", failed_peers=self.failed)


async def allreduce(
    transport: TensorTransport, tensors: Sequence[torch.Tensor], *, group: Sequence[str],
    tag: str, codec: str = "fp32", screen: ContributionScreen = DEFAULT_SCREEN,
    on_reject: Callable[[Rejection], None] | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The mean over ``group`` of each tensor: new tensors, or written into ``out`` (returned).

    ``out`` holds one floating tensor per input, of the same shape; it may be ``tensors``
    itself (in place). A single contiguous fp32 ``out`` is the result buffer itself, so a
    caller that reuses it across rounds allocates nothing. On failure the contents of ``out``
    are undefined — in place, the inputs too (keep a copy to retry).
    """
    me = transport.peer_id
    _check_group(group, me)
    codecs.check_codec(codec)
    if codec == "raw":
        codec = "fp32"
    for t in tensors:
        if not t.dtype.is_floating_point:
            raise LocalProtocolError(f"allreduce needs floating tensors, got {t.dtype}")
    if out is not None:
        _check_out(out, tensors)
    flat = _flatten(tensors)
    n, rank = len(group), list(group).index(me)
    if n == 1:
        if out is None:
            return [t.detach().clone() for t in tensors]
        _copy_results(out, list(tensors))
        return list(out)
    bounds = _part_bounds(flat.numel(), n)
    result = _result_buffer(out, flat)
    # In place over one fp32 tensor the mean overwrites the input, part by part: the part
    # sent to group[j] is overwritten only by what group[j] gathers back, which it sends after
    # it received all of that part.
    aliased = result.numel() > 0 and result.data_ptr() == flat.data_ptr()
    with ExitStack() as stack:
        scratch = streaming = None
        if codec == "fp32":  # every incoming part can land in its final place, with no copy
            scratch = _lease_scratch(transport, stack, bounds[rank], n)
            if scratch is not None and only_screens_norms(screen):
                streaming = _streaming_mean(flat, result, scratch, rank, bounds, aliased)
            _post_in_place(transport, stack, result, group, rank, bounds, tag, scratch, streaming)
        rejected = await _reduce_scatter(
            transport, flat, result, group, rank, bounds, tag, codec, screen, scratch, aliased, streaming
        )
        for rejection in rejected:
            if on_reject is not None:
                on_reject(rejection)
        await _all_gather(transport, result, group, rank, bounds, tag + "/ag", codec)
    means = _unflatten(result, tensors)
    if out is None:
        return means
    if not (len(out) == 1 and out[0].data_ptr() == result.data_ptr()):
        _copy_results(out, means)
    return list(out)


def _check_out(out: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    if len(out) != len(tensors):
        raise LocalProtocolError(f"out has {len(out)} tensors for {len(tensors)} inputs")
    for o, t in zip(out, tensors, strict=True):
        if o.shape != t.shape or not o.dtype.is_floating_point:
            raise LocalProtocolError(f"out tensor {tuple(o.shape)} {o.dtype} for input {tuple(t.shape)}")
        if o.requires_grad and o.is_leaf:
            raise LocalProtocolError("out cannot be a leaf that requires grad")


def _result_buffer(out: Sequence[torch.Tensor] | None, flat: torch.Tensor) -> torch.Tensor:
    """The flat fp32 buffer the mean is assembled in: ``out`` itself when it is one contiguous
    fp32 tensor that is either the input's memory or does not overlap it, else a new one."""
    if out is not None and len(out) == 1:
        o = out[0]
        if o.dtype == torch.float32 and o.is_contiguous() and o.numel() == flat.numel():
            candidate = o.detach().view(-1)
            if candidate.numel() == 0 or candidate.data_ptr() == flat.data_ptr():
                return candidate
            a, b = candidate.data_ptr(), flat.data_ptr()
            size = flat.numel() * 4
            if a + size <= b or b + size <= a:
                return candidate
    return torch.empty(flat.numel(), dtype=torch.float32)


def _copy_results(out: Sequence[torch.Tensor], means: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for o, m in zip(out, means, strict=True):
            o.copy_(m)


def _lease_scratch(
    transport: TensorTransport, stack: ExitStack, own: tuple[int, int], n: int
) -> torch.Tensor | None:
    """A scratch buffer (uint8) with one slot per member for this member's part, or None
    when the part is empty."""
    part_bytes = (own[1] - own[0]) * 4
    return stack.enter_context(transport.lease_scratch(part_bytes * n)) if part_bytes else None


def _slot(scratch: torch.Tensor, j: int, part_bytes: int) -> torch.Tensor:
    return scratch[j * part_bytes : (j + 1) * part_bytes]


def _streaming_mean(
    flat: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, rank: int,
    bounds: Sequence[tuple[int, int]], aliased: bool,
) -> StreamingMean:
    """Sums this member's part into ``out`` while the contributions land in their slots;
    in place, its own contribution is kept in its free slot as the sum overwrites it."""
    lo, hi = bounds[rank]
    part_bytes = (hi - lo) * 4
    parts = [_slot(scratch, j, part_bytes).view(torch.float32) for j in range(len(bounds))]
    if not aliased:
        parts[rank] = flat[lo:hi]
    return StreamingMean(parts, out[lo:hi], whole=[rank], keep_index=rank if aliased else None)


def _post_in_place(
    transport: TensorTransport, stack: ExitStack, out: torch.Tensor, group: Sequence[str], rank: int,
    bounds: Sequence[tuple[int, int]], tag: str, scratch: torch.Tensor | None, streaming: StreamingMean | None,
) -> None:
    """Post gathered parts into ``out`` and reduce-scatter parts into their ``scratch`` slots
    (this member's own slot stays free), each reporting its progress to ``streaming``."""
    lo, hi = bounds[rank]
    part_bytes = (hi - lo) * 4
    if scratch is not None:
        for j, peer in enumerate(group):
            if j != rank:
                view = codecs.byte_view(_slot(scratch, j, part_bytes))
                watch = partial(streaming.arrived, j) if streaming is not None else None
                _post(transport, stack, peer, tag + "/rs", rank, view, watch)
    for j, peer in enumerate(group):
        a, b = bounds[j]
        if j != rank and b > a:
            _post(transport, stack, peer, tag + "/ag", j, codecs.byte_view(out[a:b]))


def _post(
    transport: TensorTransport, stack: ExitStack, peer: str, tag: str, part: int, view: memoryview,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    transport.post_receive(peer, tag, part, view, on_progress)
    stack.callback(transport.post_receive, peer, tag, part, None)


async def _reduce_scatter(
    transport: TensorTransport, flat: torch.Tensor, out: torch.Tensor, group: Sequence[str], rank: int,
    bounds: Sequence[tuple[int, int]], tag: str, codec: str, screen: ContributionScreen,
    scratch: torch.Tensor | None, aliased: bool, streaming: StreamingMean | None,
) -> list[Rejection]:
    """Leave the screened mean of this member's part in ``out`` (as every receiver will decode it).

    When ``out`` is ``flat`` (in place), the part sent to ``group[j]`` is overwritten only by
    what ``group[j]`` gathers back, which it sends after it received all of that part. With
    ``streaming``, the sum was taken while the contributions arrived; only its verdict is left.
    """
    lo, hi = bounds[rank]
    received: dict[int, torch.Tensor] = {}
    phase = _Round(transport, tag + "/rs")

    async def take(j: int) -> None:
        received[j] = _single_part(await transport.receive(group[j], phase.tag, part=rank), hi - lo, group[j])
        if streaming is not None:
            try:
                streaming.landed(j, received[j])
            except ValueError as exc:  # part of a first copy reached the slot: a resend
                raise RemoteProtocolError(str(exc), peer_id=group[j]) from None

    def body(nursery: trio.Nursery) -> None:
        for j, peer in enumerate(group):
            if j != rank:
                a, b = bounds[j]
                send = partial(transport.send, codec=codec, part=j)
                nursery.start_soon(phase.guarded, peer, send, peer, phase.tag, [flat[a:b]])
                nursery.start_soon(phase.guarded, peer, take, j)

    await phase.run(body)
    if streaming is not None:
        return streaming.finish(screen, group)
    own = _through(flat[lo:hi], codec)
    if aliased and own.numel() and own.data_ptr() == out[lo:hi].data_ptr():
        # The sum is written over this member's own contribution: keep a copy in its free slot.
        part_bytes = (hi - lo) * 4
        if scratch is not None:
            slot = scratch[rank * part_bytes : (rank + 1) * part_bytes].view(torch.float32)
            np.copyto(slot.numpy(), own.detach().numpy())  # on this thread (see screen.py)
            own = slot
        else:
            own = own.clone()
    received[rank] = own
    total = out[lo:hi]
    _, rejected = reduce_parts([received[j] for j in range(len(group))], list(group), screen, out=total)
    if codec != "fp32":
        total.copy_(_through(total, codec))
    return rejected


async def _all_gather(
    transport: TensorTransport, out: torch.Tensor, group: Sequence[str], rank: int,
    bounds: Sequence[tuple[int, int]], tag: str, codec: str,
) -> None:
    mine = out[bounds[rank][0] : bounds[rank][1]]
    phase = _Round(transport, tag)

    async def take(j: int) -> None:
        a, b = bounds[j]
        got = _single_part(await transport.receive(group[j], phase.tag, part=j), b - a, group[j])
        if b > a and got.data_ptr() != out[a:b].data_ptr():
            out[a:b] = got

    def body(nursery: trio.Nursery) -> None:
        for j, peer in enumerate(group):
            if j != rank:
                send = partial(transport.send, codec=codec, part=rank)
                nursery.start_soon(phase.guarded, peer, send, peer, phase.tag, [mine])
                nursery.start_soon(phase.guarded, peer, take, j)

    await phase.run(body)


async def exchange(
    transport: TensorTransport, tensors: Sequence[torch.Tensor], *, peer: str, tag: str,
    codec: str = "fp32",
) -> list[torch.Tensor]:
    """Send ``tensors`` to ``peer`` and return what it sent under the same ``tag``."""
    if peer == transport.peer_id:
        raise LocalProtocolError("cannot exchange with ourselves")
    codecs.check_codec(codec)
    got: list[torch.Tensor] = []
    phase = _Round(transport, tag + "/x")

    async def take() -> None:
        got.extend(t for _, t in await transport.receive(peer, phase.tag))

    def body(nursery: trio.Nursery) -> None:
        send = partial(transport.send, codec=codec)
        nursery.start_soon(phase.guarded, peer, send, peer, phase.tag, list(tensors))
        nursery.start_soon(phase.guarded, peer, take)

    await phase.run(body)
    return got


def _check_group(group: Sequence[str], me: str) -> None:
    if len(set(group)) != len(group):
        raise LocalProtocolError("group lists a peer twice")
    if me not in group:
        raise LocalProtocolError(f"{me} is not in the group")


def _part_bounds(length: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    if len(tensors) == 1 and tensors[0].dtype == torch.float32:
        return tensors[0].detach().reshape(-1)  # a view when contiguous; never written to
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].reshape(t.shape).to(t.dtype))
        offset += n
    return out


def _through(x: torch.Tensor, codec: str) -> torch.Tensor:
    """What a receiver of ``x`` in ``codec`` decodes (fp32 is exact, no copy needed)."""
    return x if codec == "fp32" else codecs.roundtrip(x, codec).to(torch.float32)


def _single_part(got: list[tuple[str, torch.Tensor]], numel: int, peer: str) -> torch.Tensor:
    if len(got) != 1:
        raise RemoteProtocolError(f"expected one part tensor, got {len(got)}", peer_id=peer)
    t = got[0][1]
    if t.dtype != torch.float32 or tuple(t.shape) != (numel,):
        raise RemoteProtocolError(f"part has shape {tuple(t.shape)} {t.dtype}", peer_id=peer)
    return t
