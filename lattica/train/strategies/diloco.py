"""DiLoCo: Distributed Low-Communication training (Douillard et al., 2023, arXiv 2311.08105).

Theory of operation
-------------------
Every replica holds the shared outer weights φ (fp32; on the CPU — pinned when training on
CUDA — or with ``outer_state_device = "same"`` on the training device, ``outer_placement.py``)
and trains its own copy θ with the inner optimizer. After every ``inner_steps`` (H) inner steps:

1. Δ_m = φ − θ_m, the pseudo-gradient of this replica (``pseudo_gradient``);
2. Δ = mean of Δ_m over the members of the round (one all-reduce through the ``Collective``);
3. φ is updated by SGD with Nesterov momentum using Δ as its gradient — exactly
   ``torch.optim.SGD(nesterov=True)``: b ← μ·b + Δ; φ ← φ − η·(Δ + μ·b) (η 0.7, μ 0.9);
4. θ ← φ. The inner optimizer state (AdamW moments) is kept, never averaged or reset.

Invariant: every member of a completed round receives the same Δ and starts from the same φ and
b, and the outer step is deterministic fp32 math on the CPU (or on the same kind of device
everywhere), so all replicas hold bit-identical φ afterwards. Failure: if the all-reduce breaks
because a peer vanished, the round is retried with a fresh group (the provider leaves the dead
peer out); if every attempt fails the round is skipped — φ stays, θ keeps training, and the next
round's Δ covers both rounds.

Gossip averaging (``averaging = "gossip"``, see ``gossip.py``): instead of one all-reduce over
the round's members, each replica exchanges ``[φ_m, Δ_m]`` with the partners of its small group
for the round (``group_size``, redrawn every round), sets φ to the group's mean φ and takes the
Nesterov step with the group's mean Δ (its own momentum buffer). No peer waits for anyone
outside its group; a partner that does not answer within ``exchange_timeout_s`` is left out,
and alone a replica steps on its own Δ. Replicas then differ (``replicas_agree`` is False);
``consensus_distance`` is the last measured relative spread.

Overlapped gossip (``overlap = True``, with gossip only): the exchange of round t runs in the
strategy's nursery during round t+1's inner phase and lands at its end, as eager DiLoCo does
with its all-reduce (``eager.py``): a partner up to a whole inner phase out of phase with this
peer is then met without anyone waiting, and a partner that died costs only what is left of the
grace after that phase. At the end of round t a replica (1) takes its fresh pseudo-gradient
Δ_m^t = s_m − θ_m from where its phase started, (2) lands round t−1's exchange exactly as
gossip without overlap does (φ_m ← the group's mean φ, then the Nesterov step on its mean
Δ^{t−1}; φ_m has not changed since it was sent), (3) launches round t's exchange of
``[φ_m, Δ_m^t]`` and (4) starts round t+1 from eager's look-ahead with its own fresh Δ_m^t
(``eager_start``), which leaves φ_m and its momentum as they are. Landing before launching
keeps every φ sent current: sent before the landing, a replica's spread would be pulled in
twice (once by each of two rounds' means) and pairs would swing past each other. ``finish``
lands the last exchange and sets θ ← φ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from lattica.config import DEFAULT_INNER_STEPS, Averaging, OuterStateDevice, check_averaging
from lattica.coordination.groups import proposed_group
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
from lattica.train.strategies.gossip import (
    consensus_distance,
    exchange_with_partners,
    group_mean,
    left_out_detail,
    phi_and_delta,
    realigned_round,
    screen_answers,
)
from lattica.train.strategies.outer_math import (
    check_tensors,
    eager_start,
    nesterov_sgd,
    outer_copy,
    pseudo_gradient,
)
from lattica.train.strategies.traffic import allreduce_bytes, payload_bytes

log = logging.getLogger(__name__)

# overlapped gossip, first sync: nothing lands yet (its exchange is in flight); no outer step
FIRST_IN_FLIGHT = "first exchange in flight: it lands at the next sync"


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = 0.7
    # None: 0.9 with all-reduce (DiLoCo's paper); 0.5 with gossip — NoLoCo's μ for steps on a
    # small group's mean Δ, noisier than the global mean (docs/strategies.md, measured)
    outer_momentum: float | None = None
    codec: str = "fp32"
    max_attempts: int = 3
    averaging: Averaging = "allreduce"  # or "gossip": average inside small groups redrawn every round
    group_size: int = 2  # gossip: members per group
    exchange_timeout_s: float = 5.0  # gossip: the grace a partner has (the run setting group_grace_s)
    overlap: bool = False  # gossip: round t's exchange runs during round t+1's inner phase
    outer_state_device: OuterStateDevice = "cpu"  # or "same": the training device (outer_placement.py)

    @property
    def momentum(self) -> float:
        """The outer momentum in force (``outer_momentum``, or its default for ``averaging``)."""
        assert self.outer_momentum is not None  # set in __post_init__
        return self.outer_momentum

    def __post_init__(self) -> None:
        check_averaging(self.averaging, self.group_size, self.overlap, where="DiLoCoConfig.")
        if self.outer_momentum is None:
            object.__setattr__(self, "outer_momentum", 0.5 if self.averaging == "gossip" else 0.9)
        if not self.exchange_timeout_s > 0:
            raise ValueError(f"DiLoCoConfig.exchange_timeout_s must be > 0, got {self.exchange_timeout_s}")
        if self.inner_steps < 1:
            raise ValueError(f"DiLoCoConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            raise ValueError(f"DiLoCoConfig.outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(
                f"DiLoCoConfig.outer_momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"DiLoCoConfig.max_attempts must be >= 1, got {self.max_attempts}")
        OuterPlacement(where=self.outer_state_device)  # validates it


@dataclass
class _GossipFlight:
    """An overlapped gossip exchange: launched at the end of one round, landed at the next."""

    round: int
    key: str
    payload: list[torch.Tensor]  # [φ as sent, Δ]
    done: trio.Event = field(default_factory=trio.Event)
    partners: tuple[str, ...] = ()
    answers: list[list[torch.Tensor]] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)


class DiLoCo(EveryHSteps[DiLoCoConfig], AccountedStrategy[DiLoCoConfig]):
    """Blocking DiLoCo: one all-reduce of the pseudo-gradient every ``inner_steps`` steps."""

    replicas_agree = True
    name = "diloco"
    config_class = DiLoCoConfig

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        return isinstance(config, DiLoCoConfig) and config.averaging == "gossip"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: DiLoCoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        placement = OuterPlacement(where=self.config.outer_state_device)
        self._names, self._inner, self._outer = outer_copy(model, placement)
        self.outer_optimizer = nesterov_sgd(self._outer, self.config.outer_lr, self.config.momentum)
        self._round = 0  # index of the next sync; advances even when a round is skipped
        self._completed = 0
        self._step = 0  # inner step at which the last round ran
        # gossip averaging: replicas differ by design, and their spread is measured
        self.replicas_agree = self.config.averaging == "allreduce"
        # overlapped gossip: where this inner phase started, and the exchange in flight
        self._start = clone_like(self._outer) if self.config.overlap else self._outer
        self._in_flight: _GossipFlight | None = None

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        momentum = [s["momentum_buffer"] for s in self.outer_optimizer.state.values()]
        start = tensor_bytes(self._start) if self.config.overlap else 0
        return tensor_bytes(self._outer) + tensor_bytes(momentum) + start

    @property
    def round(self) -> int:
        return self._round

    def outer_parameters(self) -> list[torch.Tensor]:
        return self._outer

    @property
    def sync_interval(self) -> int:
        return self.config.inner_steps

    async def sync_at(self, step: int) -> OuterStepReport:
        self._step = step
        return await self.sync()

    async def sync(self) -> OuterStepReport:
        """Run one outer round now (normally called every ``inner_steps`` steps)."""
        if self.config.overlap:
            return await self._overlapped_gossip_sync()
        if self.config.averaging == "gossip":
            return await self._gossip_sync()
        key, started = f"round/{self._round}", time.monotonic()
        self._round += 1
        deltas = host_copies(pseudo_gradient(self._outer, self._inner))  # what crosses the network
        sent, failure = 0, ""
        for attempt in range(self.config.max_attempts):
            group = tuple(
                await self.groups.group_for(key if attempt == 0 else f"{key}/retry/{attempt}")
            )
            sent += allreduce_bytes(deltas, len(group), self.config.codec)
            try:
                mean = await self.collective.allreduce(
                    deltas, group=group, tag=f"diloco/{key}/{attempt}", codec=self.config.codec
                )
            except (PeerUnavailableError, BrokenError) as exc:
                failure = str(exc)
                log.info("sync %s attempt %d with %s failed: %s", key, attempt, ", ".join(group), exc)
                continue
            self._apply(mean)
            self._copy_outer_to_model()
            self.traffic.record_sync(sent)
            return OuterStepReport(
                round=self._round - 1,
                key=key,
                group=group,
                bytes_sent=sent,
                seconds=time.monotonic() - started,
            )
        self.traffic.record_sync(sent)
        return OuterStepReport(
            round=self._round - 1,
            key=key,
            group=(),
            bytes_sent=sent,
            seconds=time.monotonic() - started,
            skipped=True,
            detail=failure,
        )

    async def _gossip_sync(self) -> OuterStepReport:
        """Average ``[φ, Δ]`` with this round's group, then step on the group's mean Δ."""
        started = time.monotonic()
        flight = self._next_flight(host_copies(self._outer + pseudo_gradient(self._outer, self._inner)))
        await self._exchange(flight)
        report = self._land(flight, started)
        self._copy_outer_to_model()
        return report

    async def _overlapped_gossip_sync(self) -> OuterStepReport:
        """Land the previous round's exchange, launch this round's, start the next phase from
        the look-ahead of this round's own Δ (module docstring)."""
        if self.nursery is None:
            raise LocalProtocolError("DiLoCo with overlap needs bind_nursery() before the first round")
        started = time.monotonic()
        fresh = pseudo_gradient(self._start, self._inner)
        previous, self._in_flight = self._in_flight, None
        if previous is None:  # the first round: nothing to land yet
            report = None
        else:
            await previous.done.wait()
            report = self._land(previous, started)
        flight = self._next_flight([*(host_clone(t) for t in self._outer), *host_copies(fresh)])
        self._in_flight = flight
        self.nursery.start_soon(self._exchange, flight)
        momentum = [self.outer_optimizer.state.get(p, {}).get("momentum_buffer") for p in self._outer]
        self._begin_phase(eager_start(self._outer, momentum, fresh, lr=self.config.outer_lr,
                                      momentum_factor=self.config.momentum))
        return report or OuterStepReport(round=flight.round, key=flight.key, group=(), bytes_sent=0, seconds=0.0,
                                         skipped=True, detail=FIRST_IN_FLIGHT)

    async def finish(self) -> list[OuterStepReport]:
        """Overlapped gossip: land the exchange still in flight and set θ ← φ."""
        last, self._in_flight = self._in_flight, None
        if last is None:
            return []
        started = time.monotonic()
        await last.done.wait()
        report = self._land(last, started)
        self._begin_phase(self._outer)
        return [report]

    def _next_flight(self, payload: list[torch.Tensor]) -> _GossipFlight:
        """The next round's exchange of ``payload`` (its key: the swarm's next round when this
        replica fell behind, ``realigned_round``)."""
        self._round = realigned_round(self.groups, self._round)
        flight = _GossipFlight(round=self._round, key=f"round/{self._round}", payload=payload)
        self._round += 1
        return flight

    async def _exchange(self, flight: _GossipFlight) -> None:
        """Confirm the round's group and exchange the payload with its partners; ``done`` is set
        however it ends (cancelled too)."""
        try:
            me = self.collective.peer_id
            members = await self.groups.group_for(flight.key)
            stripe = proposed_group(members, me, key=flight.key, group_size=self.config.group_size)
            flight.partners = tuple(p for p in stripe if p != me)
            flight.missing = set(flight.partners)
            self.traffic.record_sync(payload_bytes(flight.payload, self.config.codec) * len(flight.partners))
            flight.answers, flight.missing = await exchange_with_partners(
                self.collective, flight.partners, flight.payload, tag=f"diloco/gossip/{flight.key}",
                codec=self.config.codec, timeout_s=self.config.exchange_timeout_s,
            )
        finally:
            flight.done.set()

    def _land(self, flight: _GossipFlight, started: float) -> OuterStepReport:
        """φ ← the group's mean φ, then the Nesterov step on its mean Δ (own Δ alone). φ is
        what was sent: nothing changes it between a flight's launch and its landing."""
        n = len(self._outer)
        sent = flight.payload
        answered = [p for p in flight.partners if p not in flight.missing]
        accepted, answers = screen_answers(self.partner_screen, sent, answered, flight.answers, phi_and_delta)
        spread = None
        if answers:
            contributions = [sent, *answers]
            mean_phi = group_mean([c[:n] for c in contributions])
            spread = consensus_distance(sent[:n], mean_phi)
            with torch.no_grad():
                for outer, mean in zip(self._outer, mean_phi, strict=True):
                    outer.copy_(mean)
            mean_delta = group_mean([c[n:] for c in contributions])
        else:
            mean_delta = sent[n:]
        self._apply(mean_delta)
        return OuterStepReport(
            round=flight.round,
            key=flight.key,
            group=tuple(sorted({self.collective.peer_id, *accepted})),
            bytes_sent=payload_bytes(sent, self.config.codec) * len(flight.partners),
            seconds=time.monotonic() - started,
            detail=left_out_detail(flight.missing, set(answered) - set(accepted)),
            consensus_distance=spread,
        )

    def _apply(self, mean: Sequence[torch.Tensor]) -> None:
        """The Nesterov outer step on ``mean``; the caller sets where θ goes next."""
        for outer, delta in zip(self._outer, mean, strict=True):
            outer.grad = delta.to(device=outer.device, dtype=torch.float32)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        self._completed += 1

    def _copy_outer_to_model(self) -> None:
        copy_into(self._inner, self._outer)

    def _begin_phase(self, start: Sequence[torch.Tensor]) -> None:
        """Overlapped gossip: the next inner phase starts at ``start`` (s ← start, θ ← start)."""
        copy_into(self._start, start)
        copy_into(self._inner, self._start)

    def outer_state_dict(self) -> StateDict:
        momentum = {}
        for name, param in zip(self._names, self._outer, strict=True):
            buf = self.outer_optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is not None:
                momentum[name] = host_clone(buf)
        return {
            "round": self._round,
            "step": self._step,
            "completed_rounds": self._completed,
            "params": {n: host_clone(p) for n, p in zip(self._names, self._outer, strict=True)},
            "momentum": momentum,
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        params, momentum = state["params"], state.get("momentum", {})
        check_tensors("params", params, self._names, self._outer, require_all=True)
        check_tensors("momentum", momentum, self._names, self._outer, require_all=False)
        with torch.no_grad():
            for name, outer in zip(self._names, self._outer, strict=True):
                outer.copy_(params[name])
                if name in momentum:
                    self.outer_optimizer.state[outer]["momentum_buffer"] = (
                        momentum[name].to(device=outer.device, dtype=torch.float32, copy=True)
                    )
                else:
                    self.outer_optimizer.state.pop(outer, None)
        self._round = int(state["round"])
        self._completed = int(state.get("completed_rounds", self._round))
        self._step = int(state.get("step", self._round * self.config.inner_steps))
        self._in_flight = None  # an exchange of the replaced state is not landed on the new one
        if self.config.overlap:
            self._begin_phase(self._outer)
        else:
            self._copy_outer_to_model()
