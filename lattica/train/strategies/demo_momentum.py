"""DeMo: Decoupled Momentum optimization (Peng, Quesnelle, Kingma et al., 2024, arXiv 2411.19870).

Theory of operation
-------------------
DeMo replaces the inner optimizer and syncs at every step. Each replica keeps a local momentum
m per parameter (fp32, CPU). After backward of every step, with the step's learning rate η:

1. m ← β·m + η·ĝ (β 0.999), ĝ this replica's gradient clipped to global L2 norm ``grad_clip``
   (1.0), as the reference's trainer clips before its optimizer step (the trainer's own clip
   runs after this hook, too late for m);
2. m is cut into blocks — 2-D tensors into ``chunk`` × ``chunk`` tiles, 1-D tensors into runs of
   ``chunk`` (a dimension that ``chunk`` does not divide uses its largest divisor below it) — and
   each block goes through an orthonormal DCT-II (``dct_matrix``);
3. of every block the ``topk`` coefficients of largest magnitude q are kept (values rounded to
   ``value_codec``: by default int8, 8 bits each with one fp32 scale per block, ``demo_codec``)
   and removed from m as receivers decode them: m ← m − IDCT(q); what was not sent, rounding
   error included, stays in m (error feedback);
4. members exchange their q (``sparse_gather``: indices in the smallest scheme, values), and
   each computes Q = (1/M) Σ q_m in fp32 in group order, over the q that the screen accepts
   alike at every member (``sparse_gather.screen_gathered``: with three members or more, one
   whose coefficients' norm is above ``max_norm_ratio`` × the median is left out). The group is agreed with the group
   provider once per window of ``inner_steps`` steps (key ``round/W``, at the window's first
   step) and reused for every step of the window: a per-step exchange waits for no agreement
   (a round coordinator's seal can take up to its deadline on a loaded machine);
5. θ ← (1 − ηλ)·θ − η·sign(IDCT(Q)), and the gradient is cleared so the trainer's optimizer
   step leaves the parameter alone.

Invariants: every member of a completed step applies the same Q to the same θ with the same
CPU fp32 arithmetic, so replicas stay bit-identical; the momenta differ by design (they are
each replica's own backlog, like AdamW moments, and are never exchanged).

Failure: a failed exchange is retried with a fresh group from the provider (``step/S/retry/N``),
which then serves the rest of the window; if every attempt fails the step is
skipped: θ keeps its value and IDCT(q) is added back to m, so nothing leaves m that was not
applied. A joiner or a restarted replica starts with m = 0: like any inner optimizer state it
is local, and an empty backlog is consistent (it owes nothing). The parameters are the only
shared state (``outer_state_dict``).

Chunk 64 and β 0.999 follow the reference code; its top 32 of fp16 (or fp32) values is not
the default: 8-bit values carry 189 coefficients of a 64 × 64 tile (4.6 %) in the bytes fp16
needs for 98, which on the benchmark is 1.018 × DDP's loss on both seeds at 20× fewer bytes,
where top 32 at fp16 stays 6–7 % behind (docs/strategies.md, "DeMo"). 1-D runs of 64 send all
their coefficients (k = min(topk, 64)).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from lattica.config import DEFAULT_INNER_STEPS
from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.numerics import demo_codec, sparse
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import GroupProvider, OuterStepReport
from lattica.train.strategies.sparse_gather import gather_with_retries, screen_gathered


@dataclass(frozen=True, kw_only=True)
class DeMoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS  # steps per reported round (DeMo itself syncs every step)
    chunk: int = 64
    topk: int = 189  # per 64 x 64 tile (4.6 %); the reference's 32 at fp16 is 1.065 x DDP, see docs
    momentum_decay: float = 0.999
    weight_decay: float = 0.0
    # each replica clips its own gradient (global L2 norm) before folding it into m, as the
    # reference does; the trainer's clip runs after this strategy's hook, too late for m
    grad_clip: float = 1.0
    lr_scale: float = 1.0  # the sign step is lr_scale × the trainer's learning rate
    value_codec: str = "int8"  # 8-bit values, a scale per tile: 1.9x the coefficients of fp16 per byte
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"DeMoConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not 1 <= self.chunk <= 4096:
            raise ValueError(f"DeMoConfig.chunk must be in [1, 4096], got {self.chunk}")
        if self.topk < 1:
            raise ValueError(f"DeMoConfig.topk must be >= 1, got {self.topk}")
        if not 0.0 <= self.momentum_decay < 1.0:
            raise ValueError(f"DeMoConfig.momentum_decay must be in [0, 1), got {self.momentum_decay}")
        if not self.lr_scale > 0:
            raise ValueError(f"DeMoConfig.lr_scale must be > 0, got {self.lr_scale}")
        if self.weight_decay < 0:
            raise ValueError(f"DeMoConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"DeMoConfig.grad_clip must be >= 0 (0: no clipping), got {self.grad_clip}")
        if self.value_codec not in demo_codec.VALUE_CODECS:
            raise ValueError(f"DeMoConfig.value_codec must be one of {demo_codec.VALUE_CODECS}")
        if self.max_attempts < 1:
            raise ValueError(f"DeMoConfig.max_attempts must be >= 1, got {self.max_attempts}")


@cache
def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n × n): X = D x, x = Dᵀ X."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(torch.float32)


def clip_factor(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """The factor that brings the global L2 norm of ``grads`` down to ``max_norm`` (1.0 when it
    is within, or when ``max_norm`` is 0: no clipping)."""
    if not max_norm:
        return 1.0
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    return min(1.0, max_norm / (norm + 1e-6))


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class BlockShape:
    """How one tensor is tiled: viewed as ``rows × cols``, in ``r × c`` tiles."""

    rows: int
    cols: int
    r: int
    c: int

    @property
    def blocks(self) -> int:
        return (self.rows // self.r) * (self.cols // self.c)

    @property
    def block_numel(self) -> int:
        return self.r * self.c


def block_shape(shape: torch.Size, chunk: int) -> BlockShape:
    """1-D (and 0-D) tensors as one row; n-D tensors as ``shape[0] × rest``."""
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = numel // rows if rows else 0
    if len(shape) >= 2:
        return BlockShape(rows, cols, largest_divisor(rows, chunk), largest_divisor(cols, chunk))
    return BlockShape(1, cols, 1, largest_divisor(cols, chunk))


def to_blocks(x: torch.Tensor, bs: BlockShape) -> torch.Tensor:
    """``x`` -> DCT coefficients, ``[blocks, r·c]`` (row-major tiles)."""
    tiles = x.reshape(bs.rows // bs.r, bs.r, bs.cols // bs.c, bs.c).permute(0, 2, 1, 3)
    coeffs = dct_matrix(bs.r) @ tiles @ dct_matrix(bs.c).T
    return coeffs.reshape(bs.blocks, bs.block_numel)


def from_blocks(coeffs: torch.Tensor, bs: BlockShape, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``to_blocks``."""
    tiles = coeffs.reshape(bs.rows // bs.r, bs.cols // bs.c, bs.r, bs.c)
    x = dct_matrix(bs.r).T @ tiles @ dct_matrix(bs.c)
    return x.permute(0, 2, 1, 3).reshape(shape)


class BlockLayout:
    """All tensors' DCT blocks, grouped by block size into segments (one top-k layout each)."""

    def __init__(self, shapes: Sequence[torch.Size], chunk: int, topk: int) -> None:
        self.shapes = list(shapes)
        self.tiles = [block_shape(s, chunk) for s in self.shapes]
        self.sizes = sorted({t.block_numel for t in self.tiles})
        self.k = {n: min(topk, n) for n in self.sizes}
        self.chunks = {n: sum(t.blocks for t in self.tiles if t.block_numel == n) for n in self.sizes}

    def split(self, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Block-size -> ``[blocks, size]`` coefficients of every tensor with that block size."""
        rows: dict[int, list[torch.Tensor]] = {n: [] for n in self.sizes}
        for t, tiles in zip(tensors, self.tiles, strict=True):
            rows[tiles.block_numel].append(to_blocks(t, tiles))
        return {n: torch.cat(r) for n, r in rows.items()}

    def join(self, segments: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of ``split``: the tensors back from their coefficients."""
        used = dict.fromkeys(self.sizes, 0)
        out = []
        for shape, tiles in zip(self.shapes, self.tiles, strict=True):
            n = tiles.block_numel
            out.append(from_blocks(segments[n][used[n] : used[n] + tiles.blocks], tiles, shape))
            used[n] += tiles.blocks
        return out


def extract_fast_components(
    momenta: Sequence[torch.Tensor], layout: BlockLayout, value_codec: str
) -> dict[int, sparse.SparseChunks]:
    """The top-k DCT coefficients of every block (values as receivers decode them)."""
    return {
        n: demo_codec.quantized(sparse.top_k_per_chunk(coeffs.reshape(-1), chunk=n, k=layout.k[n]), value_codec)
        for n, coeffs in layout.split(momenta).items()
    }


def dense_tensors(components: dict[int, sparse.SparseChunks], layout: BlockLayout) -> list[torch.Tensor]:
    """IDCT of sparse coefficients: the tensors they stand for."""
    segments = {
        n: sparse.densify(s, s.chunks * n).view(s.chunks, n) for n, s in components.items()
    }
    return layout.join(segments)


def mean_components(
    contributions: Sequence[dict[int, sparse.SparseChunks]], layout: BlockLayout
) -> list[torch.Tensor]:
    """IDCT of Q = (1/M) Σ q_m, summed in fp32 in the given order."""
    segments = {}
    for n in layout.sizes:
        total = torch.zeros(layout.chunks[n] * n, dtype=torch.float32)
        for contribution in contributions:
            sparse.add_into(total, contribution[n])
        segments[n] = (total / len(contributions)).view(layout.chunks[n], n)
    return layout.join(segments)


def _values(contribution: dict[int, sparse.SparseChunks]) -> torch.Tensor:
    """The decoded coefficients of a contribution, all blocks in one flat tensor."""
    return torch.cat([c.values.reshape(-1) for _, c in sorted(contribution.items())])


class DeMo(AccountedStrategy[DeMoConfig]):
    """Every step: exchange the fast DCT components of the momentum, step by the sign of their mean."""

    replicas_agree = True
    name = "demo"
    config_class = DeMoConfig
    syncs_gradients = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: DeMoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.momenta = [torch.zeros(p.shape, dtype=torch.float32) for p in self._params]
        self.layout = BlockLayout([p.shape for p in self._params], self.config.chunk, self.config.topk)
        self.applied_steps = 0  # steps whose mean arrived and was applied
        self._step = 0  # the last inner step seen
        self._rounds = 0  # reported rounds of ``inner_steps`` steps
        self._round_group: tuple[str, ...] = ()
        # the group of the current window of ``inner_steps`` steps: agreed once per window
        self._window = -1
        self._window_group: tuple[str, ...] = ()
        self._round_bytes, self._round_skips = 0, 0
        self._round_started = time.monotonic()

    @property
    def completed_rounds(self) -> int:
        return self._rounds

    @property
    def outer_state_bytes(self) -> int:
        return tensor_bytes(self.momenta)

    def _lr(self) -> float:
        if self.inner_optimizer is None:
            raise LocalProtocolError("DeMo takes its learning rate from the trainer's optimizer")
        return float(self.inner_optimizer.param_groups[0]["lr"]) * self.config.lr_scale

    async def before_optimizer_step(self, step: int) -> None:
        cfg, lr = self.config, self._lr()
        with torch.no_grad():
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", torch.float32)
                for p in self._params
            ]
            scale = clip_factor(grads, cfg.grad_clip)
            for m, g in zip(self.momenta, grads, strict=True):
                m.mul_(cfg.momentum_decay).add_(g, alpha=lr * scale)
            sent = extract_fast_components(self.momenta, self.layout, cfg.value_codec)
            removed = dense_tensors(sent, self.layout)
            for m, r in zip(self.momenta, removed, strict=True):
                m.sub_(r)
        payload = [demo_codec.encode(sent[n], codec=cfg.value_codec) for n in self.layout.sizes]
        update, group = await self._gather_mean(step, payload, sent)
        self._step = step
        self._round_group = group
        with torch.no_grad():
            if update is None:  # nothing applied: the sent components go back into m
                self._round_skips += 1
                for m, r in zip(self.momenta, removed, strict=True):
                    m.add_(r)
            else:
                for p, u in zip(self._params, update, strict=True):
                    if cfg.weight_decay:
                        p.mul_(1.0 - lr * cfg.weight_decay)
                    p.add_(u.sign().to(p.device, p.dtype), alpha=-lr)
                self.applied_steps += 1
            for p in self._params:
                p.grad = None  # the trainer's optimizer step skips parameters without a gradient

    async def _gather_mean(
        self, step: int, payload: list[torch.Tensor], sent: dict[int, sparse.SparseChunks]
    ) -> tuple[list[torch.Tensor] | None, tuple[str, ...]]:
        key = f"step/{step}"
        outcome = await gather_with_retries(
            self.collective, self.groups, payload, key=key, tag=f"demo/{key}",
            attempts=self.config.max_attempts, decode=self._decode, own=sent,
            group=await self._group_of_window(step), on_refused=self.partner_screen.refuse,
        )
        self.traffic.record_sync(outcome.bytes_sent)
        self._round_bytes += outcome.bytes_sent
        if outcome.gathered is None:
            return None, ()
        self._window_group = outcome.group  # a retry's fresh group serves the rest of the window
        accepted = screen_gathered(
            outcome.gathered, outcome.group, _values, self.partner_screen, me=self.collective.peer_id,
        )
        if not accepted:
            return None, ()
        return mean_components(accepted, self.layout), outcome.group

    async def _group_of_window(self, step: int) -> tuple[str, ...]:
        """The group for the steps of one window (``inner_steps`` steps, the reported round):
        agreed with the provider (``round/W``) at the window's first step, then reused — the
        per-step exchange needs no agreement, so a slow agreement costs once per window."""
        window = (step - 1) // self.config.inner_steps
        if window != self._window:
            self._window_group = tuple(await self.groups.group_for(f"round/{window}"))
            self._window = window
        return self._window_group

    def _decode(self, tensors: list[torch.Tensor], peer: str) -> dict[int, sparse.SparseChunks]:
        sizes = self.layout.sizes
        if len(tensors) != len(sizes):
            raise RemoteProtocolError(
                f"expected {len(sizes)} sparse payloads, got {len(tensors)}", peer_id=peer
            )
        return {
            n: demo_codec.decode(
                t, codec=self.config.value_codec, chunk=n, k=self.layout.k[n],
                chunks=self.layout.chunks[n], peer_id=peer,
            )
            for n, t in zip(sizes, tensors, strict=True)
        }

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        """Every ``inner_steps`` steps, one report for the steps since the last one (for the
        daemon: progress, published state, catch-up); the syncs themselves ran every step."""
        if step % self.config.inner_steps:
            return []
        skips = self._round_skips
        report = OuterStepReport(
            round=self._rounds, key=f"round/{self._rounds}", group=() if skips else self._round_group,
            bytes_sent=self._round_bytes, seconds=time.monotonic() - self._round_started,
            skipped=skips > 0, detail=f"{skips} step(s) skipped" if skips else "",
        )
        if not skips:  # a replica that missed a step is off the others' line until it catches up
            self._rounds += 1
        self._round_bytes, self._round_skips, self._round_started = 0, 0, time.monotonic()
        return [report]

    def outer_state_dict(self) -> StateDict:
        """The shared state: the parameters (momenta are local, see the module doc)."""
        return {
            "round": self._rounds,
            "step": self._step,
            "completed_rounds": self._rounds,
            "params": {
                n: p.detach().to("cpu", torch.float32, copy=True)
                for n, p in zip(self._names, self._params, strict=True)
            },
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        params = state.get("params", {})
        if not isinstance(params, dict) or set(params) != set(self._names):
            raise ValueError("DeMo outer state must hold every trainable parameter")
        with torch.no_grad():
            for name, p in zip(self._names, self._params, strict=True):
                given = params[name]
                if not isinstance(given, torch.Tensor) or given.shape != p.shape:
                    raise ValueError(f"DeMo outer state {name!r} has the wrong type or shape")
                p.copy_(given.to(p.device, p.dtype))
        for m in self.momenta:
            m.zero_()
        self._window, self._window_group = -1, ()  # the next step agrees on a group afresh
        self._rounds = int(state["completed_rounds"] if "completed_rounds" in state else state.get("round", 0))
        self._step = int(state.get("step", self._rounds * self.config.inner_steps))
