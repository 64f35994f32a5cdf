"""CO2: DiLoCo with the outer update one round late, its exchange hidden behind the next phase.

Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation Overlap"
(ICLR 2024, arXiv 2401.16265).

Theory of operation
-------------------
Blocking DiLoCo stops training while a round's all-reduce is on the wire. CO2 launches the
all-reduce of round t's pseudo-gradient and goes straight on with round t+1's inner steps; the
mean arrives during them and is applied at the end of round t+1. Every replica keeps the shared
outer state — the outer weights φ, the outer momentum m, and φ' (the outer weights when the
pseudo-gradient in flight was taken) — identical on every member, and its own start point s_m
(where its current inner phase began). At the end of round t worker m:

1. takes its pseudo-gradient Δ_m^t = s_m − θ_m;
2. waits for the mean Δ^{t−1} of the previous round (it had a whole inner phase to arrive)
   and applies it to the shared state (``co2_outer_step``), then launches the all-reduce of
   Δ_m^t in the strategy's nursery:

   - **staleness gap penalty**: Δ^{t−1} was taken when the shared weights were φ', and φ has
     moved since by the last outer update. Per tensor ℓ, Λ_ℓ = 1 + λ·‖φ_ℓ − φ'_ℓ‖ / ‖φ'_ℓ‖
     (the layer's relative movement while the update was in flight, λ =
     ``staleness_penalty``) and the update is scaled by 1/Λ_ℓ — the further the weights moved,
     the less a stale update is trusted;
   - outer momentum: m ← μ·m + Δ^{t−1}/Λ;
   - **outer momentum clipping**: every element of m is clipped to [−c, c]
     (c = ``momentum_clip``; None: off), bounding the step a stale update can cause;
   - φ' ← φ (where Δ^t was taken); φ ← φ − η·m;

3. starts round t+1 from the step its own fresh Δ_m^t would give if it were the round's mean
   (``look_ahead``): s_m ← φ − η·clip(μ·m + Δ_m^t), θ_m ← s_m; φ and m are not changed by it.

Why the look-ahead (as in eager DiLoCo, ``eager.py``): starting every phase at the shared φ
throws away the last round's progress until its mean lands, so every phase restarts one update
behind and the next pseudo-gradient repeats much of the last one; on the 4-worker benchmark that
ended 40 % above DiLoCo's loss (docs/strategies.md). The outer step is linear in its gradient,
so the mean over the workers of their starts is the step the round's mean would give: the
workers start, on average, where an undelayed outer step would have put them, each off by its
own share of the round's spread, which the landing of the true mean forgets.

The first round has nothing to land. ``finish`` waits for the last mean, applies it and sets
θ ← φ, so every worker that finishes holds the same weights, every round's pseudo-gradient
applied once.

Every quantity in the outer step is shared — the mean, φ, φ' and m — so the step is the same
deterministic fp32 arithmetic on every member and replicas hold bit-identical outer state after
each landed round (``replicas_agree``), as with DiLoCo; joining and repair adopt it by hash.

The reference implementation (OpenNLPLab's fairscale CO2) divides by a constant gap penalty and
clamps the momentum element-wise; here the penalty is computed from the gap as the paper
describes it, from shared quantities only (so it cannot split the replicas), and the element-wise
clamp is on by default with the reference's threshold of 1.0. The defaults of η and μ are the
reference implementation's (1.0, 0.5): heavy momentum on a one-round-late gradient oscillates
(eager DiLoCo diverged at μ 0.9, ``eager.py``).

Landing before launching: round t's all-reduce starts once round t−1's has ended. Δ_m^t does
not depend on the landing, so the order changes no value, and the mean of t−1 has normally
arrived long before; but a member that launched round t first could ask for it while its
partners had not asked for round t−1 yet — two rounds ahead of them, which the round
coordinator reads as a partner fetching the run's state, and seals round t without it.

Changing membership: after a sync the shared state still awaits one mean, that of the round
launched at it (``awaiting`` in the outer state; [] after ``finish``). A member that adopts a
state (a joiner, a restarted member, a repair) keeps the all-reduce it has in flight: when that
flight's round is the one the adopted state awaits — it took part in the holders' all-reduce —
its mean is exactly what the holders land next, and the replicas stay on one line. A member
without it (a joiner, a member restarted from its checkpoint) cannot land that round: its next
sync reports it skipped, it owes a catch-up like any member whose round was skipped, and adopts
the holders' state after their landing, keeping the flight it launched at that sync, which is
the one their new state awaits. A flight of a replaced state that is not awaited is never
landed: landing it would apply a round's mean twice or onto a line that never had it.

Failure: the background all-reduce is retried with a fresh group (``max_attempts``); when every
attempt fails, nothing is applied for that round (φ and m stay, as in a skipped DiLoCo round),
and the replicas whose attempt succeeded differ from it until repair.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
from lattica.train.strategies.base import EveryHSteps, GroupProvider, OuterStepReport
from lattica.train.strategies.eager import InFlight
from lattica.train.strategies.outer_math import outer_copy, pseudo_gradient
from lattica.train.strategies.traffic import allreduce_bytes

log = logging.getLogger(__name__)

FIRST_IN_FLIGHT = "first all-reduce in flight: it lands at the next sync"
MEAN_NOT_HELD = "the mean this state awaits was in flight before it was adopted: the holders' next state brings it"


@dataclass(frozen=True, kw_only=True)
class CO2Config:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = 1.0
    outer_momentum: float = 0.5
    staleness_penalty: float = 1.0  # λ: 0 turns the penalty off
    momentum_clip: float | None = 1.0  # c: element-wise bound on the outer momentum; None: off
    codec: str = "fp32"
    max_attempts: int = 3
    outer_state_device: OuterStateDevice = "cpu"  # or "same": the training device (outer_placement.py)

    def __post_init__(self) -> None:
        OuterPlacement(where=self.outer_state_device)  # validates it
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"inner_steps must be an integer >= 1, got {self.inner_steps!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not self.staleness_penalty >= 0:
            raise ValueError(f"staleness_penalty must be >= 0, got {self.staleness_penalty}")
        if self.momentum_clip is not None and not self.momentum_clip > 0:
            raise ValueError(f"momentum_clip must be > 0 (or None: off), got {self.momentum_clip}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


def staleness_factors(outer: Sequence[torch.Tensor], base: Sequence[torch.Tensor], penalty: float) -> list[float]:
    """Λ_ℓ = 1 + λ·‖φ_ℓ − φ'_ℓ‖ / ‖φ'_ℓ‖ per tensor (1 where φ'_ℓ is all zeros)."""
    factors = []
    for phi, old in zip(outer, base, strict=True):
        norm = float(old.detach().to(torch.float32).norm())
        gap = float((phi.detach().to(torch.float32) - old.detach().to(torch.float32)).norm())
        factors.append(1.0 + penalty * gap / norm if norm > 0 else 1.0)
    return factors


def co2_outer_step(
    outer: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    base: Sequence[torch.Tensor],
    mean: Sequence[torch.Tensor],
    config: CO2Config,
) -> list[float]:
    """In place, the delayed outer step (module docstring): Λ from φ and φ'; then φ' ← φ (where
    the pseudo-gradient launched at this sync was taken); m ← clip(μ·m + Δ/Λ); φ ← φ − η·m.
    Returns the factors Λ used."""
    factors = staleness_factors(outer, base, config.staleness_penalty)
    with torch.no_grad():
        for phi, m, old, delta, factor in zip(outer, momentum, base, mean, factors, strict=True):
            old.copy_(phi)
            m.mul_(config.outer_momentum).add_(delta.to(device=m.device, dtype=torch.float32), alpha=1.0 / factor)
            if config.momentum_clip is not None:
                m.clamp_(-config.momentum_clip, config.momentum_clip)
            phi.add_(m, alpha=-config.outer_lr)
    return factors


def look_ahead(
    outer: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], fresh_own: Sequence[torch.Tensor],
    config: CO2Config,
) -> list[torch.Tensor]:
    """s = φ − η·clip(μ·m + Δ_m): the outer step this worker's own fresh Δ_m would give if it
    were the round's mean, without changing φ or m (module docstring)."""
    starts = []
    for phi, m, delta in zip(outer, momentum, fresh_own, strict=True):
        ahead = m.mul(config.outer_momentum).add_(delta.to(device=m.device, dtype=torch.float32))
        if config.momentum_clip is not None:
            ahead.clamp_(-config.momentum_clip, config.momentum_clip)
        starts.append(phi - config.outer_lr * ahead)
    return starts


class CO2(EveryHSteps[CO2Config], AccountedStrategy[CO2Config]):
    """Overlapped DiLoCo with the outer update applied one round late (module docstring)."""

    name = "co2"
    config_class = CO2Config
    replicas_agree = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: CO2Config | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        placement = OuterPlacement(where=self.config.outer_state_device)
        self._names, self._inner, self._outer = outer_copy(model, placement)
        self._momentum = [torch.zeros_like(t) for t in self._outer]
        self._base = clone_like(self._outer)  # φ': the shared weights when the one in flight was taken
        self._start = clone_like(self._outer)  # s: where this worker's inner phase started
        self._in_flight: InFlight | None = None
        self._awaiting: int | None = None  # the round whose mean the shared state still lacks
        self._missed = False  # a sync had no mean to land for the state's awaited round
        self._round = 0  # all-reduces launched (the next one's key)
        self._completed = 0  # means landed
        self._step = 0
        self.last_factors: list[float] = []

    @property
    def sync_interval(self) -> int:
        return self.config.inner_steps

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        return sum(tensor_bytes(t) for t in (self._outer, self._momentum, self._base, self._start))

    def outer_parameters(self) -> list[torch.Tensor]:
        return self._outer

    def rounds_landed_late(self) -> int:
        return 1

    def lands_next_round(self) -> bool:
        """The mean the shared state awaits is in flight here, and no mean of this line is
        missing (a replica that could not land one is off the line until it adopts)."""
        return self._awaited_flight() is not None and not self._missed

    async def sync_at(self, step: int) -> OuterStepReport:
        if self.nursery is None:
            raise LocalProtocolError("CO2 needs bind_nursery() before the first round")
        started = time.monotonic()
        self._step = step
        fresh = pseudo_gradient(self._start, self._inner)
        previous, awaited = self._awaited_flight(), self._awaiting
        report: OuterStepReport | None = None
        if previous is not None:  # landed before the next launch: see "Landing before launching"
            report = await self._land(previous, started)
        elif awaited is not None:
            report, self._missed = self._not_held(awaited), True
        self._in_flight = self._launch(host_copies(fresh))
        self._awaiting = self._in_flight.round
        if report is None:
            report = OuterStepReport(
                round=self._in_flight.round, key=self._in_flight.key, group=(), bytes_sent=0, seconds=0.0,
                skipped=True, detail=FIRST_IN_FLIGHT,
            )
        if report.skipped:  # no outer step: φ' ← φ all the same
            copy_into(self._base, self._outer)
        self._begin_phase(look_ahead(self._outer, self._momentum, fresh, self.config))
        return report

    async def finish(self) -> list[OuterStepReport]:
        """Land the all-reduce still in flight and set θ ← φ."""
        last, awaited = self._awaited_flight(), self._awaiting
        self._in_flight, self._awaiting = None, None
        if last is not None:
            report = await self._land(last, time.monotonic())
        elif awaited is not None:
            report = self._not_held(awaited)
        else:
            return []
        self._begin_phase(self._outer)
        return [report]

    def _awaited_flight(self) -> InFlight | None:
        """The all-reduce in flight when it is the one whose mean the shared state awaits (not
        one launched on a state since replaced, module docstring "Changing membership")."""
        flight = self._in_flight
        return flight if flight is not None and flight.round == self._awaiting else None

    @staticmethod
    def _not_held(awaited: int) -> OuterStepReport:
        """The report of a landing whose mean this replica never had: it adopted the state while
        the mean was in flight among the holders (module docstring "Changing membership")."""
        return OuterStepReport(
            round=awaited, key=f"round/{awaited}", group=(), bytes_sent=0, seconds=0.0, skipped=True,
            detail=MEAN_NOT_HELD,
        )

    def _launch(self, fresh: list[torch.Tensor]) -> InFlight:
        assert self.nursery is not None
        flight = InFlight(round=self._round, key=f"round/{self._round}", own=fresh)
        self._round += 1
        self.nursery.start_soon(self._reduce, flight)
        return flight

    async def _reduce(self, flight: InFlight) -> None:
        """The round's all-reduce, retried with a fresh group; ``done`` is set however it ends."""
        try:
            for attempt in range(self.config.max_attempts):
                key = flight.key if attempt == 0 else f"{flight.key}/retry/{attempt}"
                flight.group = tuple(await self.groups.group_for(key))
                sent = allreduce_bytes(flight.own, len(flight.group), self.config.codec)
                flight.bytes_sent += sent
                try:
                    flight.mean = await self.collective.allreduce(
                        flight.own, group=flight.group, tag=f"co2/{key}", codec=self.config.codec,
                    )
                    break
                except (PeerUnavailableError, BrokenError) as exc:
                    flight.error = str(exc)
                    log.info("co2 %s attempt %d with %s failed: %s", flight.key, attempt, ", ".join(flight.group), exc)
            self.traffic.record_sync(flight.bytes_sent)
        finally:
            flight.done.set()

    async def _land(self, flight: InFlight, started: float) -> OuterStepReport:
        """Apply the mean of ``flight`` to the shared state (nothing when it failed)."""
        await flight.done.wait()
        if flight.mean is not None:
            self.last_factors = co2_outer_step(self._outer, self._momentum, self._base, flight.mean, self.config)
            self._completed += 1
        return OuterStepReport(
            round=flight.round, key=flight.key, group=flight.group if flight.mean is not None else (),
            bytes_sent=flight.bytes_sent, seconds=time.monotonic() - started,
            skipped=flight.mean is None, detail=flight.error if flight.mean is None else "",
        )

    def _begin_phase(self, start: Sequence[torch.Tensor]) -> None:
        """The next inner phase starts at ``start``: s ← start, θ ← start."""
        copy_into(self._start, start)
        copy_into(self._inner, self._start)

    def outer_state_dict(self) -> StateDict:
        def named(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {n: host_clone(t) for n, t in zip(self._names, tensors, strict=True)}

        return {
            "params": named(self._outer), "momentum": named(self._momentum), "base": named(self._base),
            "round": self._round, "step": self._step, "completed_rounds": self._completed,
            "awaiting": [] if self._awaiting is None else [self._awaiting],
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        """Take ``state`` as the shared outer state. An all-reduce in flight here is kept: when
        its round is the one ``state`` awaits, its mean is the one the holders land next
        (module docstring "Changing membership")."""
        for group in ("params", "momentum", "base"):
            given = state.get(group)
            if not isinstance(given, dict) or set(given) != set(self._names):
                raise ValueError(f"outer state {group} must name every parameter")
            for name, ref in zip(self._names, self._outer, strict=True):
                if not isinstance(given[name], torch.Tensor) or given[name].shape != ref.shape:
                    raise ValueError(f"outer state {group}[{name!r}] has the wrong type or shape")
        rnd = int(state["round"])
        awaiting = _awaited_round(state.get("awaiting", []), rnd)
        with torch.no_grad():
            for group, tensors in (("params", self._outer), ("momentum", self._momentum), ("base", self._base)):
                for name, t in zip(self._names, tensors, strict=True):
                    t.copy_(state[group][name])
        self._round, self._awaiting, self._missed = rnd, awaiting, False
        self._completed = int(state.get("completed_rounds", self._round))
        self._step = int(state.get("step", self._round * self.config.inner_steps))
        self._begin_phase(self._outer)


def _awaited_round(awaiting: object, rnd: int) -> int | None:
    """The round a state's ``awaiting`` entry names (None: no mean in flight). Only the last
    round launched (``round`` − 1) can be in flight."""
    if awaiting == []:
        return None
    if awaiting != [rnd - 1] or rnd < 1:
        raise ValueError(f"outer state awaiting must be [] or [round - 1] = [{rnd - 1}], got {awaiting!r}")
    return rnd - 1
