"""Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512).

Theory of operation
-------------------
The model is cut into P fragments: transformer block ℓ goes to fragment ℓ mod P (strided), and
each remaining parameter (embeddings, final norm) to the fragment that is smallest so far.
Fragment p keeps its own outer weights θ̃_p and its own Nesterov state, and syncs every H inner
steps at steps s ≥ H with s ≡ p·H/P (mod H), so only about 1/P of the model is on the wire at
a time. At fragment p's sync (step s):

1. Δ_p = θ̃_p − θ_p is quantized to 4-bit (E2M1 with a scale per block, ``quantize.py``) and
   sent in the strategy's nursery; training goes on;
2. at step s + τ the mean of the dequantized contributions (summed in fp32, in group order, so
   every member gets the same bits) is applied: θ̃_p ← Nesterov_p(θ̃_p, Δ_p);
3. the local fragment is merged: θ_p ← α·θ_p + (1 − α)·θ̃_p.

With ``codec="fp4"`` the packed codes are all-gathered with ``exchange`` (each member sends its
payload to the M − 1 others: for the paper's two workers that equals an all-reduce). Any other
codec name goes through ``Collective.allreduce`` with that codec (e.g. the data plane's
``int4``). Evaluation uses the outer weights θ̃. Failure: if a fragment's exchange fails
(``PeerUnavailableError``/``BrokenError``, or a peer's payload has the wrong shape:
``RemoteProtocolError``) that fragment's sync is skipped — θ̃_p stays and the
next sync of the fragment covers both periods.

Where the work runs: the snapshot of Δ_p (1.) and the outer step with mixing (2.–3.) are tensor
math between two inner steps; quantizing, sending and averaging run on the trio thread, each
in one pass over the whole fragment (``quantize_each``, ``mean_of_each``: bit for bit the
tensor-by-tensor result, with a few torch calls instead of ~200 per tensor, each of which could
take the GIL from the training thread). The
trainer lets ``sync_in_thread`` do the tensor math in its worker thread, which hands the
exchange to the event loop without waiting and goes on with the next inner step; a mean that
has not arrived by step s + τ is waited for in that thread. The inner steps never hand off to
the event loop for a fragment.

Eager fragments (``eager=True``; the strategy ``streaming_eager``): the eager updates of
``eager.py`` per fragment — the overlap of Kale et al. (2025) on top of Streaming DiLoCo. A
fragment's mean may take until the fragment's next sync, H steps later, instead of τ. At
fragment p's sync the worker sends Δ_p = s_p − θ_p (s_p: where the fragment's current phase
started), applies the previous sync's mean to the shared θ̃_p with the fragment's Nesterov
state, and restarts the fragment from the step its own fresh Δ_p would give (``diloco.eager_start``):
θ_p ← s_p ← θ̃_p − η·(Δ_p + μ·(μ·b_p + Δ_p)). ``overlap_steps`` and ``mixing`` do not apply. θ̃
is the same on every replica (the same means in the same order); the live weights differ by
each worker's own look-ahead until ``finish``, which applies the last means and sets θ ← θ̃. A
failed fragment sync is applied as the worker's own Δ_p.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from lattica.config import DEFAULT_INNER_STEPS
from lattica.errors import (
    BrokenError,
    LocalProtocolError,
    PeerUnavailableError,
    RemoteProtocolError,
)
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.quantize import (
    DEFAULT_BLOCK_SIZE,
    Quantized4Bit,
    dequantize_4bit,
    quantize_4bit,
)
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import GroupProvider, OuterStepReport
from lattica.train.strategies.outer_math import eager_start, nesterov_sgd, pseudo_gradient
from lattica.train.strategies.traffic import allreduce_bytes, payload_bytes


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    fragments: int = 2
    overlap_steps: int = 2
    mixing: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "fp4"
    block_size: int = DEFAULT_BLOCK_SIZE
    # eager fragment updates: a mean may take H steps, not τ; overlap_steps and mixing unused
    eager: bool = False

    def __post_init__(self) -> None:
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError("fragments must be >= 1 and divide inner_steps")
        if not self.eager and not 0 <= self.overlap_steps < self.inner_steps:
            raise ValueError("overlap_steps must be in [0, inner_steps)")
        if not 0.0 <= self.mixing <= 1.0:
            raise ValueError(f"mixing must be in [0, 1], got {self.mixing}")
        if self.outer_lr <= 0 or not 0.0 < self.outer_momentum < 1.0:
            raise ValueError("need outer_lr > 0 and 0 < outer_momentum < 1")


def fragment_indices(model: torch.nn.Module, fragments: int) -> list[list[int]]:
    """Parameter indices (in ``model.parameters()`` order) of each fragment."""
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    groups: list[list[int]] = [[] for _ in range(fragments)]
    sizes = [0] * fragments
    placed: set[int] = set()
    blocks = getattr(model, "blocks", None)
    for layer, block in enumerate(blocks if isinstance(blocks, torch.nn.ModuleList) else []):
        for p in block.parameters():
            groups[layer % fragments].append(position[id(p)])
            sizes[layer % fragments] += p.numel()
            placed.add(id(p))
    for p in params:
        if id(p) not in placed:
            smallest = sizes.index(min(sizes))
            groups[smallest].append(position[id(p)])
            sizes[smallest] += p.numel()
    return [sorted(g) for g in groups]


def sync_due(step: int, fragment: int, *, inner_steps: int, fragments: int) -> bool:
    """Whether fragment ``fragment`` starts a sync after inner step ``step``."""
    offset = fragment * inner_steps // fragments
    return step >= inner_steps and step % inner_steps == offset


def next_sync_start(step: int, fragment: int, *, inner_steps: int, fragments: int) -> int:
    """The first step after ``step`` at which fragment ``fragment`` starts a sync."""
    offset = fragment * inner_steps // fragments
    candidate = (step - offset) // inner_steps * inner_steps + offset + inner_steps
    while candidate < inner_steps:  # the first sync of every fragment is at step >= H
        candidate += inner_steps
    return candidate


@torch.no_grad()
def mix_into_local(
    local: Sequence[torch.Tensor], outer: Sequence[torch.Tensor], mixing: float
) -> None:
    """θ ← α·θ + (1 − α)·θ̃, in place on the local weights."""
    for theta, tilde in zip(local, outer, strict=True):
        theta.mul_(mixing).add_(tilde.to(theta.device, theta.dtype), alpha=1.0 - mixing)


@dataclass
class _FragmentSync:
    fragment: int
    key: str
    apply_at: int
    group: tuple[str, ...] = ()
    done: trio.Event = field(default_factory=trio.Event)
    arrived: threading.Event = field(default_factory=threading.Event)  # ``done``, for the worker
    mean: list[torch.Tensor] | None = None
    error: str = ""
    bytes_sent: int = 0
    own: list[torch.Tensor] = field(default_factory=list)  # eager: this worker's Δ_p


class StreamingDiLoCo(AccountedStrategy[StreamingDiLoCoConfig]):
    replicas_agree = True

    name = "streaming"
    config_class = StreamingDiLoCoConfig

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: StreamingDiLoCoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._inner = [p for _, p in named]
        self._outer = [p.detach().to("cpu", torch.float32, copy=True) for p in self._inner]
        self.fragments = fragment_indices(model, self.config.fragments)
        self.outer_optimizers = [
            nesterov_sgd(
                [self._outer[i] for i in indices] or [torch.zeros(0, requires_grad=True)],
                self.config.outer_lr, self.config.outer_momentum,
            )
            for indices in self.fragments
        ]
        # eager: where each tensor's current inner phase started (s); else unused
        self._start = [t.clone() for t in self._outer] if self.config.eager else []
        self.replicas_agree = not self.config.eager  # eager: live weights differ until finish
        self._pending: list[_FragmentSync] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._syncs_started = [0] * self.config.fragments
        self._completed = 0

    @property
    def completed_rounds(self) -> int:
        """Fragment syncs applied, divided by P: full-model rounds."""
        return self._completed // self.config.fragments

    @property
    def outer_state_bytes(self) -> int:
        momentum = [
            s["momentum_buffer"] for opt in self.outer_optimizers for s in opt.state.values()
        ]
        return tensor_bytes(self._outer) + tensor_bytes(momentum) + tensor_bytes(self._start)

    def evaluation_parameters(self) -> Sequence[torch.Tensor]:
        return self._outer

    def next_sync_step(self, step: int) -> int:
        """The next fragment sync to start or to apply."""
        h, fragments = self.config.inner_steps, self.config.fragments
        starts = [
            next_sync_start(step, p, inner_steps=h, fragments=fragments) for p in range(fragments)
        ]
        return min([*starts, *(max(s.apply_at, step + 1) for s in self._pending)])

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        begun = [self._begin(fragment, step) for fragment in self._starting(step)]
        for one in begun:
            self._launch(one)
        due = [s for s in self._pending if s.apply_at <= step]
        reports = [await self._apply(s) for s in due]
        self._restart_eagerly(begun)
        return reports

    def sync_in_thread(self, step: int) -> list[OuterStepReport]:
        """The same work as ``after_inner_step``, in the worker thread.

        The fragment snapshot and the outer step are the same tensor math on the same values in
        the same order, so the result is bit-identical. The exchange is handed to the event
        loop without waiting for it; a mean that is due and has not arrived is waited for here,
        until its exchange ends (it ends when the trainer's nursery is cancelled, too).
        """
        if self._token is None:
            raise LocalProtocolError("StreamingDiLoCo needs bind_nursery() before the first sync")
        begun = [self._begin(fragment, step) for fragment in self._starting(step)]
        for one in begun:
            self._token.run_sync_soon(self._launch, one)
        due = [s for s in self._pending if s.apply_at <= step]
        reports = [self._apply_once_arrived(s) for s in due]
        self._restart_eagerly(begun)
        return reports

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        super().bind_nursery(nursery)
        self._token = trio.lowlevel.current_trio_token()

    async def finish(self) -> list[OuterStepReport]:
        last = list(self._pending)
        reports = [await self._apply(s) for s in last]
        if self.config.eager:  # every replica ends at the shared outer weights
            for sync in last:
                indices = self.fragments[sync.fragment]
                self._restart_at(indices, [self._outer[i] for i in indices])
        return reports

    def _restart_eagerly(self, begun: list[tuple[_FragmentSync, list[torch.Tensor]]]) -> None:
        """Eager: each fragment that just sent Δ_p restarts from the step Δ_p would give."""
        if not self.config.eager:
            return
        for sync, delta in begun:
            indices = self.fragments[sync.fragment]
            optimizer = self.outer_optimizers[sync.fragment]
            outer = [self._outer[i] for i in indices]
            momentum = [optimizer.state.get(p, {}).get("momentum_buffer") for p in outer]
            start = eager_start(
                outer,
                momentum,
                delta,
                lr=self.config.outer_lr,
                momentum_factor=self.config.outer_momentum,
            )
            self._restart_at(indices, start)

    def _restart_at(self, indices: list[int], values: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, value in zip(indices, values, strict=True):
                self._start[i].copy_(value)
                self._inner[i].copy_(value)

    def _starting(self, step: int) -> list[int]:
        h, fragments = self.config.inner_steps, self.config.fragments
        return [p for p in range(fragments) if sync_due(step, p, inner_steps=h, fragments=fragments)]

    def _begin(self, fragment: int, step: int) -> tuple[_FragmentSync, list[torch.Tensor]]:
        """Number the fragment's sync and snapshot its pseudo-gradient (tensors only)."""
        k = self._syncs_started[fragment]
        self._syncs_started[fragment] += 1
        key = f"round/{k}/fragment/{fragment}"
        indices = self.fragments[fragment]
        base = self._start if self.config.eager else self._outer
        delta = pseudo_gradient([base[i] for i in indices], [self._inner[i] for i in indices])
        if self.config.eager:  # applied at the fragment's next sync (or at finish)
            sync = _FragmentSync(fragment, key, apply_at=step + self.config.inner_steps, own=delta)
        else:
            sync = _FragmentSync(fragment, key, apply_at=step + self.config.overlap_steps)
        self._pending.append(sync)
        return sync, delta

    def _launch(self, begun: tuple[_FragmentSync, list[torch.Tensor]]) -> None:
        """Trio thread: exchange in the background (the group is agreed there too: it waits for
        the others to reach this sync)."""
        if self.nursery is None:
            raise LocalProtocolError("StreamingDiLoCo needs bind_nursery() before the first sync")
        self.nursery.start_soon(self._reduce, *begun)

    async def _reduce(self, sync: _FragmentSync, delta: list[torch.Tensor]) -> None:
        tag = f"streaming/{sync.key}"
        try:
            sync.group = tuple(await self.groups.group_for(sync.key))
            if self.config.codec == "fp4":
                sync.mean = await self._gather_fp4(delta, sync, tag)
            else:
                sync.bytes_sent = allreduce_bytes(delta, len(sync.group), self.config.codec)
                self.traffic.record_sync(sync.bytes_sent)
                sync.mean = await self.collective.allreduce(
                    delta, group=sync.group, tag=tag, codec=self.config.codec
                )
        except (PeerUnavailableError, BrokenError, RemoteProtocolError) as exc:
            sync.error = str(exc)
        finally:
            sync.done.set()
            sync.arrived.set()

    async def _gather_fp4(
        self, delta: list[torch.Tensor], sync: _FragmentSync, tag: str
    ) -> list[torch.Tensor]:
        me, group = self.collective.peer_id, sync.group
        own = quantize_each(delta, block_size=self.config.block_size)
        wire = [q.codes for q in own] + [q.scales for q in own]
        others = [q for q in group if q != me]
        sync.bytes_sent = payload_bytes(wire, "raw") * len(others)
        self.traffic.record_sync(sync.bytes_sent)
        received: dict[str, list[Quantized4Bit]] = {me: own}
        failures: list[Exception] = []

        async def one(peer: str) -> None:
            try:
                answer = await self.collective.exchange(wire, peer=peer, tag=tag, codec="raw")
                received[peer] = _unpack(answer, like=own, peer=peer)
            except (PeerUnavailableError, BrokenError, RemoteProtocolError) as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for peer in others:
                nursery.start_soon(one, peer)
        if failures:
            raise failures[0]
        # the same order everywhere: bit-identical means
        return mean_of_each([received[member] for member in group], like=delta)

    async def _apply(self, sync: _FragmentSync) -> OuterStepReport:
        started = time.monotonic()
        await sync.done.wait()
        return self._apply_arrived(sync, started=started)

    def _apply_once_arrived(self, sync: _FragmentSync) -> OuterStepReport:
        """Worker thread: ``_apply``, waiting on the thread event that ``_reduce`` sets."""
        started = time.monotonic()
        sync.arrived.wait()
        return self._apply_arrived(sync, started=started)

    def _apply_arrived(self, sync: _FragmentSync, *, started: float) -> OuterStepReport:
        """Outer Nesterov step of the fragment with the arrived mean, then mixing (tensors only).

        Eager: no mixing (the fragment restarts at its sync), and a failed sync is applied as
        the worker's own Δ_p."""
        self._pending.remove(sync)
        indices = self.fragments[sync.fragment]
        gradient = sync.mean if sync.mean is not None or not self.config.eager else sync.own
        if gradient is not None:
            outer = [self._outer[i] for i in indices]
            for tilde, g in zip(outer, gradient, strict=True):
                tilde.grad = g.to(torch.float32)
            optimizer = self.outer_optimizers[sync.fragment]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not self.config.eager:
                mix_into_local([self._inner[i] for i in indices], outer, self.config.mixing)
            self._completed += 1
        return OuterStepReport(
            round=self._syncs_started[sync.fragment] - 1,
            key=sync.key,
            group=sync.group if sync.mean is not None else (),
            bytes_sent=sync.bytes_sent,
            seconds=time.monotonic() - started,
            skipped=sync.mean is None,
            detail=sync.error,
        )

    def outer_state_dict(self) -> StateDict:
        momentum = {}
        for optimizer in self.outer_optimizers:
            for name, p in zip(self._names, self._outer, strict=True):
                if p in optimizer.state:
                    momentum[name] = optimizer.state[p]["momentum_buffer"].clone()
        return {
            "params": {n: p.clone() for n, p in zip(self._names, self._outer, strict=True)},
            "momentum": momentum,
            "completed_syncs": self._completed,
            "syncs_started": list(self._syncs_started),
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        with torch.no_grad():
            for fragment, indices in enumerate(self.fragments):
                optimizer = self.outer_optimizers[fragment]
                for i in indices:
                    name, outer = self._names[i], self._outer[i]
                    outer.copy_(state["params"][name])
                    self._inner[i].copy_(outer)
                    if self.config.eager:
                        self._start[i].copy_(outer)
                    if name in state["momentum"]:
                        buffer = state["momentum"][name].to(torch.float32).clone()
                        optimizer.state[outer]["momentum_buffer"] = buffer
        self._completed = int(state["completed_syncs"])
        self._syncs_started = [int(k) for k in state["syncs_started"]]
        self._pending = []


def _padded(numel: int, block_size: int) -> int:
    return -(-numel // block_size) * block_size


def quantize_each(
    tensors: Sequence[torch.Tensor], *, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[Quantized4Bit]:
    """``[quantize_4bit(t) for t in tensors]``, bit for bit, in one pass over one buffer.

    Each tensor is padded to whole blocks in the buffer, so no block spans two tensors and every
    scale and code is the one the tensor alone would get. One pass instead of one per tensor: a
    fragment has tens of small tensors, and per tensor a dozen torch calls on the event-loop
    thread each take the GIL from the training thread.
    """
    if not tensors:
        return []
    sizes = [_padded(t.numel(), block_size) for t in tensors]
    flat = torch.zeros(sum(sizes), dtype=torch.float32)
    for piece, t in zip(torch.split(flat, sizes), tensors, strict=True):
        piece[: t.numel()] = t.detach().reshape(-1)
    whole = quantize_4bit(flat, block_size=block_size)
    codes = torch.split(whole.codes, [n // 2 for n in sizes])
    scales = torch.split(whole.scales, [n // block_size for n in sizes])
    return [
        Quantized4Bit(codes=c, scales=sc, shape=t.shape, block_size=block_size)
        for c, sc, t in zip(codes, scales, tensors, strict=True)
    ]


def mean_of_each(
    contributions: Sequence[Sequence[Quantized4Bit]], *, like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Per tensor, the fp32 mean of the members' dequantized encodings, summed in the given
    member order — bit for bit what dequantizing and summing tensor by tensor gives — with one
    dequantization per member."""
    if not like:
        return []
    block_size = contributions[0][0].block_size
    sizes = [_padded(t.numel(), block_size) for t in like]
    total = torch.zeros(sum(sizes), dtype=torch.float32)
    for encodings in contributions:
        codes = torch.cat([q.codes.reshape(-1) for q in encodings])
        scales = torch.cat([q.scales.reshape(-1) for q in encodings])
        total += dequantize_4bit(
            Quantized4Bit(codes=codes, scales=scales, shape=total.shape, block_size=block_size)
        )
    total /= len(contributions)
    return [
        piece[: t.numel()].view(t.shape)
        for piece, t in zip(torch.split(total, sizes), like, strict=True)
    ]


def _unpack(
    answer: Sequence[torch.Tensor], *, like: Sequence[Quantized4Bit], peer: str
) -> list[Quantized4Bit]:
    """Rebuild a peer's encodings from ``[codes..., scales...]``, checking their sizes."""
    n = len(like)
    if len(answer) != 2 * n:
        raise RemoteProtocolError(
            f"expected {2 * n} tensors in a fragment sync, got {len(answer)}", peer_id=peer
        )
    rebuilt = []
    for ref, codes, scales in zip(like, answer[:n], answer[n:], strict=True):
        if codes.shape != ref.codes.shape or scales.shape != ref.scales.shape:
            raise RemoteProtocolError("fragment sync tensors of the wrong size", peer_id=peer)
        rebuilt.append(
            Quantized4Bit(
                codes=codes.to(torch.uint8),
                scales=scales.to(torch.float32),
                shape=ref.shape,
                block_size=ref.block_size,
            )
        )
    return rebuilt
