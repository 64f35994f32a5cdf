"""Eager overlapped DiLoCo (Kale et al., 2025, arXiv 2502.12996).

Theory of operation
-------------------
Blocking DiLoCo stops training while the round's all-reduce is on the wire. Here the all-reduce
of round t runs in the strategy's nursery while round t+1's inner steps run; its mean Δ^t is
only needed at the end of round t+1. At the end of every round t worker m:

1. computes its fresh pseudo-gradient Δ_m^t = φ_m − θ_m and starts its all-reduce (tag t);
2. waits for the mean Δ^{t−1} of the previous round (it had a whole round to arrive);
3. uses its own fresh contribution in place of its stale share of that mean — the "eager"
   outer gradient of the paper: Δ̃_m^t = Δ^{t−1} + (Δ_m^t − Δ_m^{t−1}) / M;
4. applies SGD with Nesterov momentum to φ_m with gradient Δ̃_m^t and sets θ_m ← φ_m.

Before the first mean exists (and when a round's all-reduce failed) Δ^{t−1} is taken as the
worker's own share Δ_m^{t−1}/M, so Δ̃ reduces to Δ_m^t/M. ``finish`` waits for the last mean
and applies the same formula with no fresh progress (Δ_m^{T+1} = 0), so every worker has applied
the sum of all round means once. Replicas are close but not bit-identical: each worker's own
term differs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from lattica.config import DEFAULT_INNER_STEPS
from lattica.errors import BrokenError, LocalProtocolError, PeerUnavailableError
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import OuterStepReport
from lattica.train.strategies.diloco import nesterov_sgd, outer_copy, pseudo_gradient
from lattica.train.strategies.traffic import allreduce_bytes


@dataclass(frozen=True, kw_only=True)
class EagerDiLoCoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    codec: str = "fp32"

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 < self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in (0, 1), got {self.outer_momentum}")


def eager_outer_gradient(
    previous_mean: Sequence[torch.Tensor],
    fresh_own: Sequence[torch.Tensor],
    previous_own: Sequence[torch.Tensor],
    members: int,
) -> list[torch.Tensor]:
    """Δ̃_m^t = Δ^{t−1} + (Δ_m^t − Δ_m^{t−1}) / M."""
    return [
        mean + (fresh - stale) / members
        for mean, fresh, stale in zip(previous_mean, fresh_own, previous_own, strict=True)
    ]


@dataclass
class _InFlight:
    """A group agreement and all-reduce running in the background; ``mean`` None if it failed."""

    round: int
    key: str
    own: list[torch.Tensor]
    group: tuple[str, ...] = ()
    grouped: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    mean: list[torch.Tensor] | None = None
    bytes_sent: int = 0
    error: str = ""


class EagerDiLoCo(AccountedStrategy):
    name = "eager"
    config_class = EagerDiLoCoConfig

    def __init__(self, model, *, collective, groups, config: EagerDiLoCoConfig | None = None):
        super().__init__(model, collective=collective, groups=groups)
        self.config = config or EagerDiLoCoConfig()
        self._names, self._inner, self._outer = outer_copy(model)
        self.outer_optimizer = nesterov_sgd(self._outer, self.config.outer_lr, self.config.outer_momentum)
        self._in_flight: _InFlight | None = None
        self._completed = 0

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        momentum = [s["momentum_buffer"] for s in self.outer_optimizer.state.values()]
        return tensor_bytes(self._outer) + tensor_bytes(momentum)

    def next_sync_step(self, step: int) -> int:
        return (step // self.config.inner_steps + 1) * self.config.inner_steps

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if step % self.config.inner_steps:
            return []
        started = time.monotonic()
        round_number = step // self.config.inner_steps
        fresh = pseudo_gradient(self._outer, self._inner)
        previous = self._in_flight
        self._in_flight = await self._start(round_number, fresh)
        return [await self._apply_previous(previous, fresh, started)]

    async def finish(self) -> list[OuterStepReport]:
        last, self._in_flight = self._in_flight, None
        if last is None:
            return []
        nothing_new = [torch.zeros_like(t) for t in last.own]
        return [await self._apply_previous(last, nothing_new, time.monotonic())]

    async def _start(self, round_number: int, fresh: list[torch.Tensor]) -> _InFlight:
        if self.nursery is None:
            raise LocalProtocolError("EagerDiLoCo needs bind_nursery() before the first round")
        flight = _InFlight(round=round_number, key=f"round/{round_number}", own=fresh)
        # agreeing on the group waits for the others to reach this round: in the background too
        self.nursery.start_soon(self._reduce, flight)
        return flight

    async def _reduce(self, flight: _InFlight) -> None:
        try:
            flight.group = tuple(await self.groups.group_for(flight.key))
            flight.grouped.set()
            flight.bytes_sent = allreduce_bytes(flight.own, len(flight.group), self.config.codec)
            self.traffic.record_sync(flight.bytes_sent)
            flight.mean = await self.collective.allreduce(
                flight.own, group=flight.group, tag=f"eager/{flight.key}", codec=self.config.codec
            )
        except (PeerUnavailableError, BrokenError) as exc:
            flight.error = str(exc)
        finally:
            flight.group = flight.group or (self.collective.peer_id,)
            flight.grouped.set()
            flight.done.set()

    async def _apply_previous(
        self, previous: _InFlight | None, fresh: list[torch.Tensor], started: float
    ) -> OuterStepReport:
        """The outer step that consumes the previous round's mean (or our own share of it)."""
        members = 1
        if previous is None and self._in_flight is not None:
            # the first round has nothing in flight to overlap: M is this round's group size
            await self._in_flight.grouped.wait()
            members = len(self._in_flight.group)
        zeros = [torch.zeros_like(t) for t in fresh]
        previous_own, previous_mean, error = zeros, zeros, ""
        if previous is not None:
            await previous.done.wait()
            members = len(previous.group)
            previous_own = previous.own
            previous_mean = previous.mean or [t / members for t in previous.own]
            error = previous.error
        gradient = eager_outer_gradient(previous_mean, fresh, previous_own, members)
        for outer, g in zip(self._outer, gradient, strict=True):
            outer.grad = g
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for inner, outer in zip(self._inner, self._outer, strict=True):
                inner.copy_(outer)
        self._completed += 1
        return OuterStepReport(
            round=previous.round if previous else 0,
            key=previous.key if previous else "round/0",
            group=previous.group if previous and previous.mean is not None else (),
            bytes_sent=previous.bytes_sent if previous else 0,
            seconds=time.monotonic() - started,
            skipped=bool(error),
            detail=error,
        )

    def outer_state_dict(self) -> dict[str, Any]:
        momentum = {
            n: self.outer_optimizer.state[p]["momentum_buffer"].clone()
            for n, p in zip(self._names, self._outer, strict=True)
            if p in self.outer_optimizer.state
        }
        return {
            "params": {n: p.clone() for n, p in zip(self._names, self._outer, strict=True)},
            "momentum": momentum,
            "completed_rounds": self._completed,
        }

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, outer, inner in zip(self._names, self._outer, self._inner, strict=True):
                outer.copy_(state["params"][name])
                inner.copy_(outer)
                if name in state["momentum"]:
                    buffer = state["momentum"][name].to(torch.float32).clone()
                    self.outer_optimizer.state[outer]["momentum_buffer"] = buffer
        self._completed = int(state["completed_rounds"])
        self._in_flight = None
