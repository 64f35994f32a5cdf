"""Eager overlapped DiLoCo (Kale et al., 2025, arXiv 2502.12996).

Theory of operation
-------------------
Blocking DiLoCo stops training while the round's all-reduce is on the wire. Here the all-reduce
of round t runs in the strategy's nursery while round t+1's inner steps run; its mean Δ^t is
only needed at the end of round t+1. Every worker m keeps the shared outer state (φ, b) — the
outer weights and the Nesterov momentum, identical on every replica — and the point s_m from
which its current inner phase started. At the end of round t worker m:

1. computes its fresh pseudo-gradient Δ_m^t = s_m − θ_m and starts its all-reduce (tag t);
2. waits for the mean Δ^{t−1} of the previous round (it had a whole round to arrive) and
   applies it to the shared state exactly as DiLoCo does: (φ, b) ← Nesterov(φ, b; Δ^{t−1});
3. starts round t+1 eagerly, from the outer step that its own fresh Δ_m^t would give if it
   were the round's mean (``eager_start``): s_m ← φ − η·(Δ_m^t + μ·(μ·b + Δ_m^t)), θ_m ← s_m.
   The shared state is not changed by this look-ahead.

Why the look-ahead and not the per-worker formula Δ̃_m^t = Δ^{t−1} + (Δ_m^t − Δ_m^{t−1})/M
applied to a per-worker (φ_m, b_m): that formula feeds the others' share of every round into
the momentum one round late. Averaged over the workers its outer gradient is
Δ^t/M + (1 − 1/M)·Δ^{t−1}, a delayed gradient, and heavy momentum on a delayed gradient
oscillates: on the 4-worker benchmark it diverged at μ = 0.9 (docs/strategies.md). Here the
Nesterov step is linear in its gradient, so the mean over workers of the start points s_m is
exactly DiLoCo's next outer weights: the shared state follows DiLoCo's recursion with no
delay, and each worker's own start differs from it only by η(1+μ)(Δ_m^t − Δ^t), the spread of
one round, which is forgotten when the true mean is applied.

``finish`` waits for the last mean, applies it and sets θ ← φ, so every worker that finishes
holds the same weights. A round whose all-reduce failed is applied as the worker's own Δ_m (the
step it already started from stands); the replicas' shared states then differ by that round's
spread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from lattica.config import DEFAULT_INNER_STEPS, OuterStateDevice
from lattica.errors import BrokenError, LocalProtocolError, PeerUnavailableError
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.outer_placement import (
    OuterPlacement,
    clone_like,
    copy_into,
    host_clone,
    host_copies,
)
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import GroupProvider, OuterStepReport
from lattica.train.strategies.outer_math import eager_start, nesterov_sgd, outer_copy, pseudo_gradient
from lattica.train.strategies.traffic import allreduce_bytes

# η 0.5, not DiLoCo's 0.7: each worker starts its phase η(1+μ)·(Δ_m − Δ) away from the shared
# weights, and that spread, not the delay, is what eager pays for its overlap; with η 0.5 (μ 0.9)
# eager is within 2 % of DiLoCo at 0.7 on the 4-worker benchmark, 2.5–4.4 % at 0.7
# (docs/strategies.md, "Why eager lagged DiLoCo")
DEFAULT_EAGER_OUTER_LR = 0.5


@dataclass(frozen=True, kw_only=True)
class EagerDiLoCoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = DEFAULT_EAGER_OUTER_LR
    outer_momentum: float = 0.9
    codec: str = "fp32"
    outer_state_device: OuterStateDevice = "cpu"  # or "same": the training device (outer_placement.py)

    def __post_init__(self) -> None:
        OuterPlacement(where=self.outer_state_device)  # validates it
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 < self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in (0, 1), got {self.outer_momentum}")


@dataclass
class InFlight:
    """A group agreement and all-reduce running in the background; ``mean`` None if it failed
    (eager DiLoCo's and CO2's exchange behind the next inner phase)."""

    round: int
    key: str
    own: list[torch.Tensor]
    group: tuple[str, ...] = ()
    done: trio.Event = field(default_factory=trio.Event)
    mean: list[torch.Tensor] | None = None
    bytes_sent: int = 0
    error: str = ""


class EagerDiLoCo(AccountedStrategy[EagerDiLoCoConfig]):
    name = "eager"
    config_class = EagerDiLoCoConfig

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: EagerDiLoCoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        placement = OuterPlacement(where=self.config.outer_state_device)
        self._names, self._inner, self._outer = outer_copy(model, placement)
        self._start = clone_like(self._outer)  # s: where this inner phase started
        self.outer_optimizer = nesterov_sgd(self._outer, self.config.outer_lr, self.config.outer_momentum)
        self._in_flight: InFlight | None = None
        self._completed = 0

    @property
    def completed_rounds(self) -> int:
        """Round means applied to the shared outer state."""
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        momentum = [b for b in self._momentum() if b is not None]
        return tensor_bytes(self._outer) + tensor_bytes(momentum) + tensor_bytes(self._start)

    def next_sync_step(self, step: int) -> int:
        return (step // self.config.inner_steps + 1) * self.config.inner_steps

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if step % self.config.inner_steps:
            return []
        started = time.monotonic()
        fresh = pseudo_gradient(self._start, self._inner)
        previous, self._in_flight = self._in_flight, self._launch(step // self.config.inner_steps, fresh)
        report = await self._apply(previous, started)
        self._begin_phase(
            eager_start(
                self._outer,
                self._momentum(),
                fresh,
                lr=self.config.outer_lr,
                momentum_factor=self.config.outer_momentum,
            )
        )
        return [report]

    async def finish(self) -> list[OuterStepReport]:
        last, self._in_flight = self._in_flight, None
        if last is None:
            return []
        report = await self._apply(last, time.monotonic())
        self._begin_phase(self._outer)
        return [report]

    def _launch(self, round_number: int, fresh: list[torch.Tensor]) -> InFlight:
        if self.nursery is None:
            raise LocalProtocolError("EagerDiLoCo needs bind_nursery() before the first round")
        flight = InFlight(round=round_number, key=f"round/{round_number}", own=host_copies(fresh))
        # agreeing on the group waits for the others to reach this round: in the background too
        self.nursery.start_soon(self._reduce, flight)
        return flight

    async def _reduce(self, flight: InFlight) -> None:
        try:
            flight.group = tuple(await self.groups.group_for(flight.key))
            flight.bytes_sent = allreduce_bytes(flight.own, len(flight.group), self.config.codec)
            self.traffic.record_sync(flight.bytes_sent)
            flight.mean = await self.collective.allreduce(
                flight.own, group=flight.group, tag=f"eager/{flight.key}", codec=self.config.codec
            )
        except (PeerUnavailableError, BrokenError) as exc:
            flight.error = str(exc)
        finally:
            flight.done.set()

    async def _apply(self, flight: InFlight | None, started: float) -> OuterStepReport:
        """DiLoCo's outer step on the shared state with the mean of ``flight`` (own Δ if it failed)."""
        if flight is None:  # the first round: nothing to apply yet
            return OuterStepReport(round=0, key="round/0", group=(), bytes_sent=0, seconds=0.0)
        await flight.done.wait()
        gradient = flight.mean if flight.mean is not None else flight.own
        for outer, g in zip(self._outer, gradient, strict=True):
            outer.grad = g.to(device=outer.device, dtype=torch.float32)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        self._completed += 1
        return OuterStepReport(
            round=flight.round,
            key=flight.key,
            group=flight.group if flight.mean is not None else (),
            bytes_sent=flight.bytes_sent,
            seconds=time.monotonic() - started,
            skipped=flight.mean is None,
            detail=flight.error,
        )

    def _begin_phase(self, start: Sequence[torch.Tensor]) -> None:
        """The next inner phase starts at ``start``: s ← start, θ ← start."""
        copy_into(self._start, start)
        copy_into(self._inner, self._start)

    def _momentum(self) -> list[torch.Tensor | None]:
        return [self.outer_optimizer.state.get(p, {}).get("momentum_buffer") for p in self._outer]

    def outer_state_dict(self) -> StateDict:
        momentum = {
            n: host_clone(buf)
            for n, buf in zip(self._names, self._momentum(), strict=True)
            if buf is not None
        }
        return {
            "params": {n: host_clone(p) for n, p in zip(self._names, self._outer, strict=True)},
            "momentum": momentum,
            "completed_rounds": self._completed,
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        with torch.no_grad():
            for name, outer in zip(self._names, self._outer, strict=True):
                outer.copy_(state["params"][name])
                if name in state["momentum"]:
                    buffer = state["momentum"][name].to(device=outer.device, dtype=torch.float32, copy=True)
                    self.outer_optimizer.state[outer]["momentum_buffer"] = buffer
        self._begin_phase(self._outer)
        self._completed = int(state["completed_rounds"])
        self._in_flight = None
