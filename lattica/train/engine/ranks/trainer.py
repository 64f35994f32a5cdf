"""A trainer whose inner steps run on the node's rank processes: one member, several devices.

Theory of operation
-------------------
``RankedTrainer`` is a ``Trainer`` whose model stays in the daemon, on the CPU, as the node's
replica: the weights every phase starts from and every outer step changes. The strategy, the
outer-state sync, checkpoints and hashes see one model as on a one-device node, so the node
is one swarm member — one peer id, one outer state, one contribution per round — whatever its
number of devices. Only the inner steps move: for the steps up to the next stop
(``_run_inner_steps``) the replica's weights go into the shared buffer, every rank trains the
same steps with DDP on its slice of the node's batch (``worker.py``), and rank 0's weights
come back into the replica, with the loss, the tokens, the sampler's state and each rank's
figures (``device_status``). The outer step then runs once, in the daemon on the CPU, and its
result reaches every rank at the start of the next phase (rank 0 reads it, then broadcasts).
Validation runs on the ranks too (each an N-th of the batches).

Failure: a rank that dies, fails or hangs past the phase deadline (``HANG_FACTOR`` × the
slowest phase yet per step, at least ``MIN_PHASE_S``; ``FIRST_PHASE_S`` for the first, which
may compile) fails the phase. The group is closed (all ranks killed) and started again, and
the phase is trained again from the replica's weights, step and sampler state — the node's
last outer state, which the failed phase never touched. Up to ``MAX_RESTARTS`` restarts in a
row, with backoff; then the trainer raises ``RankFailedError`` (the service shows it and marks
the member failed). Meanwhile the others treat the node as a late peer: rounds go on without
it after their deadline and it catches up as any late replica does (``outer_sync``).
The inner optimizer's state lives in the ranks: a restart (of the ranks or the daemon)
starts it afresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trio
from trio_typing import TaskStatus

from lattica.config import TrainSettings
from lattica.errors import RankFailedError
from lattica.train.engine.checkpoint import CheckpointStore, StateDict
from lattica.train.engine.device import DeviceInfo
from lattica.train.engine.ranks.devices import NodeDevices
from lattica.train.engine.ranks.group import (
    GroupSpec,
    GroupTimeouts,
    LocalGroup,
    threads_per_rank,
    unwrapped,
)
from lattica.train.engine.ranks.messages import Message
from lattica.train.engine.ranks.weights import Layout, SharedWeights
from lattica.train.engine.reports import Progress, RoundCompleted, TrainingSummary
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies.base import OuterStrategy

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # restarts in a row of a failing group before the training fails
RESTART_BACKOFF_S = 1.0  # doubled at each restart in a row
FIRST_PHASE_S = 600.0
MIN_PHASE_S = 120.0
HANG_FACTOR = 10.0
FAILURES_SHOWN = 5


@dataclass(frozen=True)
class RanksDevice(DeviceInfo):
    """The daemon's replica is on the CPU; what the node trains on is its ranks' devices."""

    label: str = ""

    def describe(self) -> str:
        return self.label


@dataclass(frozen=True, kw_only=True)
class RankSetup:
    devices: NodeDevices
    settings: TrainSettings
    peer_id: str
    # ``module:function`` building the node's task from (settings, peer_id=...) in each worker,
    # as the daemon built it (``settings.trainer_factory.TASK_BUILDER``)
    task_builder: str
    timeouts: GroupTimeouts = field(default_factory=GroupTimeouts)


class RankedTrainer(Trainer):
    """The trainer of a node with several devices (module docstring)."""

    def __init__(
        self, task: Task, strategy: OuterStrategy[object], config: TrainerConfig, *, ranks: RankSetup,
        checkpoints: CheckpointStore | None = None, on_progress: Callable[[Progress], None] | None = None,
        on_round: Callable[[RoundCompleted], None] | None = None,
    ) -> None:
        label = f"{ranks.devices.ranks} ranks: {', '.join(ranks.devices.names)}"
        device = RanksDevice(torch.device("cpu"), None, label=label)
        super().__init__(task, strategy, config, device=device, checkpoints=checkpoints,
                         on_progress=on_progress, on_round=on_round)
        self.ranks = ranks
        self._params = list(self.model.parameters())
        self._layout = Layout.of(self._params)
        self._group: LocalGroup | None = None
        self._weights: SharedWeights | None = None
        self._nursery: trio.Nursery | None = None
        self._slowest_step_s: float | None = None
        self._reports: list[Message] = []
        self.failures: list[str] = []  # the newest last: "rank 1 (cpu:1): killed by SIGKILL at step 12"
        self.restarts = 0
        self.ranks_agree: bool | None = None

    # ------------------------------------------------------------------ the run

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> TrainingSummary:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    summary = await super().run(task_status=task_status)
                finally:
                    self._nursery = None
                    if self._group is not None:
                        with trio.CancelScope(shield=True):
                            await self._group.close()
                        self._group = None
        except BaseExceptionGroup as group:
            raise unwrapped(group) from None
        return summary

    async def _run_inner_steps(self, last: int) -> None:
        in_a_row = 0
        while True:
            try:
                group = await self._started_group()
                await self._phase(group, last)
            except RankFailedError as failure:
                in_a_row += 1
                await self._failed(failure, give_up=in_a_row > MAX_RESTARTS)
                await trio.sleep(RESTART_BACKOFF_S * 2 ** (in_a_row - 1))
            else:
                return

    async def _started_group(self) -> LocalGroup:
        if self._group is not None:
            return self._group
        if self._nursery is None:
            raise RuntimeError("the ranks run only inside RankedTrainer.run")
        self._weights = SharedWeights.create(self._layout)
        group = LocalGroup(self._group_spec(), self._weights)
        self._group = group
        await self._nursery.start(group.run)
        log.info("%d ranks ready on %s", group.world, ", ".join(str(r.get("device")) for r in group.ready.values()))
        return group

    async def _failed(self, failure: RankFailedError, *, give_up: bool) -> None:
        """Record the failure, close the group; raise once restarts in a row ran out."""
        self.failures = [*self.failures, f"{failure} at step {self.step}"][-FAILURES_SHOWN:]
        log.warning("%s at step %d; %s", failure, self.step, "giving up" if give_up else "restarting the ranks")
        if self._group is not None:
            await self._group.close()
            self._group = None
        if give_up:
            raise failure
        self.restarts += 1

    async def _phase(self, group: LocalGroup, last: int) -> None:
        assert self._weights is not None
        weights, params = self._weights, self._params
        await trio.to_thread.run_sync(weights.store, params)
        started, steps = time.monotonic(), last - self.step
        answers = await group.phase(self.step, last, self._sampler_state(), deadline_s=self._deadline(steps))
        head = answers[0]
        if not head.get("agree", False):
            raise RankFailedError("the ranks' weights differ after the phase", rank=0, device=group.spec.devices[0])
        await trio.to_thread.run_sync(weights.load, params)
        per_step = (time.monotonic() - started) / max(steps, 1)
        self._slowest_step_s = max(self._slowest_step_s or 0.0, per_step)
        self._took(answers, last)

    def _took(self, answers: list[Message], last: int) -> None:
        head = answers[0]
        tokens = sum(int(a["tokens"]) for a in answers)
        self.step, self._loss = last, torch.tensor(float(head["loss"]))
        self.tokens += tokens
        self._window_tokens += tokens
        self._set_lr(last - 1)
        if isinstance(state := head.get("sampler"), bytes) and self.task.sampler is not None:
            self.task.sampler.load_state_dict({"generator": torch.frombuffer(bytearray(state), dtype=torch.uint8)})
        self._reports, self.ranks_agree = answers, True
        peaks = [p for a in answers if isinstance(p := a.get("peak_flops"), int | float)]
        if len(peaks) == len(answers):
            self._peak_flops = float(sum(peaks))
            self._flops_per_token = head.get("flops_per_token")

    def _deadline(self, steps: int) -> float:
        if self._slowest_step_s is None:
            return FIRST_PHASE_S
        return max(MIN_PHASE_S, HANG_FACTOR * self._slowest_step_s * steps)

    def _sampler_state(self) -> bytes | None:
        if self.task.sampler is None:
            return None
        return bytes(self.task.sampler.state_dict()["generator"].contiguous().numpy().tobytes())

    def _group_spec(self) -> GroupSpec:
        s, config = self.ranks.settings, self.config
        schedule = config.schedule
        init = {
            "settings": {name: getattr(s, name) for name in s.__dataclass_fields__},
            "schedule": {"lr": schedule.lr, "warmup_steps": schedule.warmup_steps,
                         "total_steps": schedule.total_steps, "min_lr_ratio": schedule.min_lr_ratio},
            "grad_clip": config.grad_clip, "weight_decay": config.weight_decay, "peer_id": self.ranks.peer_id,
            "task_builder": self.ranks.task_builder,
            "layout": {"offsets": list(self._layout.offsets), "nbytes": self._layout.nbytes},
        }
        names = self.ranks.devices.names
        return GroupSpec(devices=names, init=init, threads_per_rank=threads_per_rank(names),
                         timeouts=self.ranks.timeouts)

    # ------------------------------------------------------------------ validation, state

    async def _evaluate_and_report(self) -> None:
        if self.task.val_batches:
            self.last_val_loss = await self._evaluate_on_ranks()
        self._report(val_loss=self.last_val_loss)

    async def _evaluate_on_ranks(self) -> float:
        """On the ranks while they run; after the run (a state adopted then) on the replica."""
        group = self._group
        if group is None or self._weights is None:
            return await trio.to_thread.run_sync(self.evaluate)
        swap = self.strategy.evaluation_parameters()
        await trio.to_thread.run_sync(self._weights.store, list(swap) if swap is not None else self._params)
        try:
            return await group.evaluate(deadline_s=self._deadline(len(self.task.val_batches)))
        except RankFailedError as failure:
            await self._failed(failure, give_up=False)  # the next phase restarts the ranks
            return await trio.to_thread.run_sync(self.evaluate)

    def state_dict(self) -> StateDict:
        state = super().state_dict()
        if self.task.sampler is not None:  # the ranks' sampler, as the last phase left it
            state["sampler"] = self.task.sampler.state_dict()
        return state

    def device_status(self) -> dict[str, object]:
        entries = []
        for rank, name in enumerate(self.ranks.devices.names):
            report = self._reports[rank] if rank < len(self._reports) else {}
            entry: dict[str, object] = {"rank": rank, "device": report.get("device") or name, "name": name}
            if self._group is not None and rank < len(self._group.procs):
                entry["pid"] = self._group.procs[rank].pid
            for key in ("tokens_per_s", "memory_bytes", "mfu"):
                if isinstance(report.get(key), int | float):
                    entry[key] = round(report[key], 4 if key == "mfu" else 1)
            entries.append(entry)
        status: dict[str, object] = {"devices": entries, "rank_restarts": self.restarts}
        if self.ranks_agree is not None:
            status["ranks_agree"] = self.ranks_agree
        if self.failures:
            status["rank_failures"] = list(self.failures)
        return status
