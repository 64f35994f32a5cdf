"""Local Adam and DES-LOC: adaptive-optimizer state kept in agreement without an outer optimizer.

Theory of operation
-------------------
Every worker runs the inner AdamW on its own shard. Nothing else is run on top of it: no outer
weights, no outer optimizer. What keeps the replicas together is averaging the quantities Adam
carries — the parameters x, the first moment u (``exp_avg``) and the second moment v
(``exp_avg_sq``) — each on its own period:

- **Local Adam** (the baseline): after every H inner steps, x, u and v are all replaced by
  their means over the workers, three model-sized tensors per sync;
- **DES-LOC** (Iacob et al., "Desynced Low Communication Adaptive Optimizers", arXiv
  2505.22549): x every K_x = H steps, u every K_u steps and v every K_v steps. The paper's
  recommendation, the defaults here, is K_u = 3·K_x and K_v = 6·K_x: a moment with decay β
  changes with a half-life of ln 0.5 / ln β steps (β₁ 0.9: 7 steps; β₂ 0.95: 14 steps), far
  slower than the parameters drift apart, so it needs averaging far less often. Traffic per
  K_x steps falls from 3P (Local Adam) to P·(1 + 1/3 + 1/6) = 1.5P: half of Local Adam's.

The paper's step t on worker m: g ← clip(∇, ρ); u ← β₁u + (1−β₁)g, then u ← mean(u) when
t mod K_u = 0; v likewise on K_v; x ← x − η·u/(√v + ε), then x ← mean(x) when t mod K_x = 0.
Each quantity is averaged right after the update that produced it, which is what this strategy
does: the trainer's AdamW takes step t (the clip ρ is the trainer's gradient clipping), and
``after_inner_step(t)`` then averages what is due, in one collective call (parameters first,
then the due moments, ``due_quantities``). The moments are averaged where AdamW keeps them, in
``optimizer.state``; bias correction is untouched (every worker has taken the same number of
steps).

Periods are whole multiples of H (``first_moment_rounds``, ``second_moment_rounds``): every
sync is then a round of the run — the parameters are always averaged — and the moments join
every few rounds. This keeps one round counter and one outer state per round, which is what
joining, catching up and checkpoints work with.

Outer state (``outer_state_dict``): the means of the last sync of each quantity — the averaged
parameters of the last round, the averaged u of the last round that averaged u, the same for
v — with the Adam step count of that round. Under all-reduce every member of a completed round
holds the same bits (``replicas_agree``), so a joiner adopts them by hash as with DiLoCo: it
takes the parameters, and initializes its moments from the last averages (the paper's recovery
for a worker that rejoins). Before the first sync those are the initial weights and zero
moments. Keeping them costs a model-sized copy per quantity on the host; the tensors kept are
the collective's results themselves, no further copy.

Gossip (``averaging = "gossip"``): each quantity due is averaged over this round's small group
instead (``gossip.py``): the payload ``[x, u?, v?]`` is exchanged with the partners, screened
segment by segment, and every member takes the group's mean. Replicas then differ by design.

Failure: a round whose all-reduce fails on every attempt is skipped — each worker keeps its
own x, u and v and the next round's averages cover it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lattica.config import DEFAULT_INNER_STEPS, Averaging, check_averaging
from lattica.coordination.groups import proposed_group
from lattica.errors import BrokenError, PeerUnavailableError
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.outer_placement import host_clone
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import EveryHSteps, GroupProvider, OuterStepReport
from lattica.train.strategies.gossip import (
    consensus_distance,
    exchange_with_partners,
    group_mean,
    left_out_detail,
    realigned_round,
    screen_answers,
)
from lattica.train.strategies.traffic import allreduce_bytes, payload_bytes

log = logging.getLogger(__name__)

PARAMS = "params"
FIRST_MOMENT = "exp_avg"  # AdamW's names for u and v in ``optimizer.state``
SECOND_MOMENT = "exp_avg_sq"
QUANTITIES = (PARAMS, FIRST_MOMENT, SECOND_MOMENT)


@dataclass(frozen=True, kw_only=True)
class LocalAdamConfig:
    """Local Adam: parameters and both moments averaged every ``inner_steps`` steps."""

    inner_steps: int = DEFAULT_INNER_STEPS  # K_x
    first_moment_rounds: int = 1  # K_u = first_moment_rounds · K_x
    second_moment_rounds: int = 1  # K_v = second_moment_rounds · K_x
    codec: str = "fp32"
    max_attempts: int = 3
    averaging: Averaging = "allreduce"  # or "gossip": average inside small groups redrawn every round
    group_size: int = 2
    exchange_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_averaging(self.averaging, self.group_size, where=f"{type(self).__name__}.")
        for name in ("inner_steps", "first_moment_rounds", "second_moment_rounds", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.exchange_timeout_s > 0:
            raise ValueError(f"exchange_timeout_s must be > 0, got {self.exchange_timeout_s}")

    @property
    def periods(self) -> dict[str, int]:
        """Inner steps between two averages of each quantity (K_x, K_u, K_v)."""
        h = self.inner_steps
        return {PARAMS: h, FIRST_MOMENT: h * self.first_moment_rounds, SECOND_MOMENT: h * self.second_moment_rounds}


@dataclass(frozen=True, kw_only=True)
class DESLOCConfig(LocalAdamConfig):
    """DES-LOC: the paper's periods, K_u = 3·K_x and K_v = 6·K_x."""

    first_moment_rounds: int = 3
    second_moment_rounds: int = 6


def due_quantities(sync_round: int, config: LocalAdamConfig) -> tuple[str, ...]:
    """What round ``sync_round`` (1-based: the sync after inner step ``sync_round``·H) averages:
    the parameters always, each moment on the rounds its period divides."""
    due = [PARAMS]
    if sync_round % config.first_moment_rounds == 0:
        due.append(FIRST_MOMENT)
    if sync_round % config.second_moment_rounds == 0:
        due.append(SECOND_MOMENT)
    return tuple(due)


def bytes_per_steps(config: LocalAdamConfig, model_bytes: int, steps: int) -> int:
    """Payload averaged in ``steps`` inner steps (before the collective's own factor): for
    DES-LOC's defaults 1.5× the model per H steps over a multiple of 6H, Local Adam's 3×."""
    rounds = steps // config.inner_steps
    return sum(len(due_quantities(r, config)) for r in range(1, rounds + 1)) * model_bytes


def split_payload(payload: Sequence[torch.Tensor], due: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """``[x..., u..., v...]`` (the quantities of ``due``, in order) as one list per quantity."""
    n = len(payload) // len(due)
    return {q: list(payload[i * n:(i + 1) * n]) for i, q in enumerate(due)}


class LocalAdam(EveryHSteps[LocalAdamConfig], AccountedStrategy[LocalAdamConfig]):
    """Local Adam: x, u and v replaced by their means every H steps (module docstring)."""

    name = "local_adam"
    config_class = LocalAdamConfig
    replicas_agree = True

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        return isinstance(config, LocalAdamConfig) and config.averaging == "gossip"

    @classmethod
    def default_config(cls) -> LocalAdamConfig:
        return LocalAdamConfig()

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: LocalAdamConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.replicas_agree = self.config.averaging == "allreduce"
        self._round = 0  # syncs started (the next one's key); advances when a round is skipped
        self._completed = 0
        self._step = 0  # inner step of the last sync
        self._adam_step = 0  # the Adam step count the kept averages belong to
        # the last average of each quantity (the outer state); initial weights, zero moments
        initial = [host_clone(p.detach()) for p in self._params]
        self._averages: dict[str, list[torch.Tensor]] = {
            PARAMS: initial, FIRST_MOMENT: [torch.zeros_like(t) for t in initial],
            SECOND_MOMENT: [torch.zeros_like(t) for t in initial],
        }
        self._pending_moments = False  # loaded before the inner optimizer was attached

    # -- the schedule ---------------------------------------------------------------------

    @property
    def sync_interval(self) -> int:
        return self.config.inner_steps

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        return sum(tensor_bytes(ts) for ts in self._averages.values())

    async def sync_at(self, step: int) -> OuterStepReport:
        self._step = step
        if self.config.averaging == "gossip":
            return await self._gossip_sync(step)
        return await self._allreduce_sync(step)

    # -- all-reduce -------------------------------------------------------------------------

    async def _allreduce_sync(self, step: int) -> OuterStepReport:
        key, started = f"round/{self._round}", time.monotonic()
        self._round += 1
        due = due_quantities(step // self.config.inner_steps, self.config)
        payload = self._payload(due)
        sent, failure = 0, ""
        for attempt in range(self.config.max_attempts):
            group = tuple(await self.groups.group_for(key if attempt == 0 else f"{key}/retry/{attempt}"))
            sent += allreduce_bytes(payload, len(group), self.config.codec)
            try:
                mean = await self.collective.allreduce(
                    payload, group=group, tag=f"{self.name}/{key}/{attempt}", codec=self.config.codec,
                )
            except (PeerUnavailableError, BrokenError) as exc:
                failure = str(exc)
                log.info("sync %s attempt %d with %s failed: %s", key, attempt, ", ".join(group), exc)
                continue
            self._take(split_payload(mean, due), step)
            self.traffic.record_sync(sent)
            return OuterStepReport(
                round=self._round - 1, key=key, group=group, bytes_sent=sent,
                seconds=time.monotonic() - started, detail="averaged " + ", ".join(due),
            )
        self.traffic.record_sync(sent)
        return OuterStepReport(
            round=self._round - 1, key=key, group=(), bytes_sent=sent,
            seconds=time.monotonic() - started, skipped=True, detail=failure,
        )

    # -- gossip -------------------------------------------------------------------------------

    async def _gossip_sync(self, step: int) -> OuterStepReport:
        started = time.monotonic()
        self._round = realigned_round(self.groups, self._round)
        key = f"round/{self._round}"
        self._round += 1
        # by the key, not the step: a replica that jumped to the swarm's round sends what its
        # partners of that round send
        due = due_quantities(self._round, self.config)
        payload = self._payload(due)
        me = self.collective.peer_id
        members = await self.groups.group_for(key)
        partners = tuple(p for p in proposed_group(members, me, key=key, group_size=self.config.group_size) if p != me)
        sent = payload_bytes(payload, self.config.codec) * len(partners)
        self.traffic.record_sync(sent)
        answers, missing = await exchange_with_partners(
            self.collective, partners, payload, tag=f"{self.name}/gossip/{key}",
            codec=self.config.codec, timeout_s=self.config.exchange_timeout_s,
        )
        answered = [p for p in partners if p not in missing]

        def segments(tensors: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
            return split_payload(tensors, due)

        accepted, kept = screen_answers(self.partner_screen, payload, answered, answers, segments)
        mean = group_mean([payload, *kept]) if kept else payload
        split = split_payload(mean, due)
        spread = consensus_distance(split_payload(payload, due)[PARAMS], split[PARAMS]) if kept else None
        self._take(split, step)
        return OuterStepReport(
            round=self._round - 1, key=key, group=tuple(sorted({me, *accepted})), bytes_sent=sent,
            seconds=time.monotonic() - started, detail=left_out_detail(missing, set(answered) - set(accepted)),
            consensus_distance=spread,
        )

    # -- the tensors --------------------------------------------------------------------------

    def _payload(self, due: Sequence[str]) -> list[torch.Tensor]:
        """Host fp32 copies of the quantities of ``due``, in order (what crosses the network)."""
        payload = [host_clone(p.detach()).to(torch.float32) for p in self._params]
        for quantity in due[1:]:
            payload.extend(host_clone(m).to(torch.float32) for m in self._moments(quantity))
        return payload

    def _moments(self, quantity: str) -> list[torch.Tensor]:
        """This worker's current ``quantity`` per parameter (zeros where AdamW has none yet)."""
        state = self.inner_optimizer.state if self.inner_optimizer is not None else {}
        return [
            state[p][quantity].detach() if quantity in state.get(p, {}) else torch.zeros_like(p, dtype=torch.float32)
            for p in self._params
        ]

    def _take(self, means: dict[str, list[torch.Tensor]], step: int) -> None:
        """Replace every averaged quantity by its mean and keep the means as the outer state."""
        with torch.no_grad():
            for param, mean in zip(self._params, means[PARAMS], strict=True):
                param.copy_(mean.to(device=param.device, dtype=param.dtype))
        for quantity in (FIRST_MOMENT, SECOND_MOMENT):
            if quantity in means:
                self._write_moments(quantity, means[quantity], step)
        self._averages.update(means)
        self._adam_step = step
        self._completed += 1

    def _write_moments(self, quantity: str, values: Sequence[torch.Tensor], step: int) -> None:
        """AdamW's ``quantity`` ← ``values`` for every parameter; state AdamW has not created
        yet (a joiner before its first step) is created at Adam step ``step``."""
        optimizer = self.inner_optimizer
        if optimizer is None:
            return
        fused = {
            id(p): bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups for p in g["params"]
        }
        with torch.no_grad():
            for param, value in zip(self._params, values, strict=True):
                state = optimizer.state[param]
                if not state:
                    on_device = fused.get(id(param), False)
                    state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                                 device=param.device if on_device else "cpu")
                    state[FIRST_MOMENT] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state[SECOND_MOMENT] = torch.zeros_like(param, memory_format=torch.preserve_format)
                target = state[quantity]
                target.copy_(value.to(device=target.device, dtype=target.dtype))

    def attach_inner_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_inner_optimizer(optimizer)
        if self._pending_moments:
            self._load_moments()

    def _load_moments(self) -> None:
        self._pending_moments = self.inner_optimizer is None
        if self._pending_moments:
            return
        for quantity in (FIRST_MOMENT, SECOND_MOMENT):
            self._write_moments(quantity, self._averages[quantity], self._adam_step)
        assert self.inner_optimizer is not None
        for param in self._params:  # the moments belong to this Adam step: bias correction agrees
            state = self.inner_optimizer.state.get(param)
            if state and "step" in state:
                state["step"].fill_(float(self._adam_step))

    # -- outer state ----------------------------------------------------------------------------

    def outer_state_dict(self) -> StateDict:
        state: StateDict = {
            q: {n: host_clone(t) for n, t in zip(self._names, self._averages[q], strict=True)} for q in QUANTITIES
        }
        state |= {"round": self._round, "step": self._step, "completed_rounds": self._completed,
                  "adam_step": self._adam_step}
        return state

    def load_outer_state_dict(self, state: StateDict) -> None:
        loaded: dict[str, list[torch.Tensor]] = {}
        for quantity in QUANTITIES:
            given = state.get(quantity)
            if not isinstance(given, dict) or set(given) != set(self._names):
                raise ValueError(f"outer state {quantity} must name every trainable parameter")
            tensors = [given[n] for n in self._names]
            for name, tensor, param in zip(self._names, tensors, self._params, strict=True):
                if not isinstance(tensor, torch.Tensor) or tensor.shape != param.shape:
                    raise ValueError(f"outer state {quantity}[{name!r}] has the wrong type or shape")
            loaded[quantity] = [t.detach().to("cpu", torch.float32, copy=True) for t in tensors]
        self._averages = loaded
        self._round = int(state["round"])
        self._completed = int(state.get("completed_rounds", self._round))
        self._step = int(state.get("step", self._round * self.config.inner_steps))
        self._adam_step = int(state.get("adam_step", self._step))
        with torch.no_grad():
            for param, value in zip(self._params, loaded[PARAMS], strict=True):
                param.copy_(value.to(device=param.device, dtype=param.dtype))
        self._load_moments()


class DESLOC(LocalAdam):
    """DES-LOC: x every H steps, u every 3H, v every 6H by default (module docstring)."""

    name = "desloc"
    config_class = DESLOCConfig

    @classmethod
    def default_config(cls) -> LocalAdamConfig:
        return DESLOCConfig()
