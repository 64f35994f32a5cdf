"""The inner loop: inner steps in a worker thread, outer syncs on the trio thread.

Theory of operation
-------------------
``Trainer.run`` repeats, until ``total_steps``:

1. in a worker thread (``trio.to_thread.run_sync``): inner steps — draw a batch, forward under
   autocast, backward, clip + ``optimizer.step()`` — one after the other up to the next step at
   which the trio thread has something to do: the strategy's ``next_sync_step`` (an outer round,
   a fragment to send or apply), a progress report, a validation or the end;
2. on the trio thread: ``await strategy.after_inner_step(step)`` for the last of those steps —
   unless the strategy did that step's sync in the worker thread (``sync_in_thread``: tensor
   math only; Streaming's fragment snapshot and the apply of a mean, waited for there if it is
   late), in which case the worker goes on to the next such step. Rounds completed there are
   recorded (``on_round``) when the trio thread next takes a step, with the outer state of
   their moment; with a checkpoint store every sync is taken on the trio thread, since a
   round's checkpoint must be written before the next inner step;
3. gradient-syncing strategies (``strategy.syncs_gradients``, e.g. the DDP baseline) instead run
   one step at a time: forward/backward in a thread, ``await strategy.before_optimizer_step``,
   the optimizer step in a thread, ``after_inner_step``.

The inner steps themselves (``_forward_backward``) run at the device's speed: the forward goes
through ``torch.compile`` where the run asks for it (``compiled_model``: on CUDA by default,
falling back to eager with one warning line), the batch was drawn and copied to the device by
a background thread while the previous step ran (``batch_prefetch``), a step's batch may be cut
into ``micro_batches`` whose gradients add up (each micro-batch's loss weighted by its share of
the batch, so the step's loss and gradient are those of the whole batch), layers may recompute
their activations in backward (``activation_checkpoint``), and the inner optimizer is AdamW in
the device's fastest implementation (``inner_optimizer``). Nothing waits for the device inside
the loop: the loss stays a device tensor and is read only when a report is made. On CUDA the
worker thread runs its steps on the trainer's own CUDA stream — after the work the trio thread
queued on the device (an outer step's θ ← φ), and finished before the trio thread takes over
again — so several trainers in one process overlap on one GPU.

The trio thread is therefore free while tensors are computed: the daemon keeps serving the
network during training, and an overlapping strategy's communication runs while the worker
thread trains. Running the steps between two syncs in one thread call matters for overlap: a
hand-off to the event loop after every step costs a thread wake-up, which on a busy machine is
milliseconds per step — time in which no inner step runs. The worker checks for cancellation
between steps, so stopping the node never waits for more than one step. The learning rate is a pure
function of the step (warmup + cosine), so
a resumed or joining peer only needs the step number. Every completed round triggers
``on_round`` (with the content hash of the outer weights, for the replicated state) and a local
checkpoint (``checkpoint_writer``: a full disk delays checkpoints, never training); periodic
validation and throughput go to ``on_progress``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import trio
from trio_typing import TaskStatus

from lattica.errors import ConfigError
from lattica.train.engine.activation_checkpoint import checkpoint_layers
from lattica.train.engine.batch_prefetch import BatchesEnded, BatchPrefetcher, prefetch_depth
from lattica.train.engine.checkpoint import CheckpointStore, StateDict
from lattica.train.engine.checkpoint_writer import CheckpointWriter
from lattica.train.engine.compiled_model import ForwardModule, compile_enabled
from lattica.train.engine.device import DeviceInfo, autocast, select_device
from lattica.train.engine.inner_optimizer import build_adamw
from lattica.train.engine.inner_step import WorkerStream, accumulate_gradients
from lattica.train.engine.reports import Progress, RoundCompleted, TrainingSummary
from lattica.train.engine.schedule import ScheduleConfig, lr_multiplier
from lattica.train.engine.task import Batch, Task
from lattica.train.engine.utilization import device_peak_flops, mfu, model_flops_per_token
from lattica.train.engine.validation import mean_validation_loss
from lattica.train.strategies.base import OuterStepReport, OuterStrategy, next_multiple

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    total_steps: int
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    log_every: int = 10
    compile: bool | Literal["auto"] = "auto"  # torch.compile the forward; auto: on CUDA only
    micro_batches: int = 1  # each step's batch in this many parts, gradients accumulated
    activation_checkpointing: bool = False  # layers recompute their activations in backward

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"TrainerConfig.total_steps must be >= 1, got {self.total_steps}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("TrainerConfig.weight_decay and grad_clip must be >= 0")
        if self.eval_every < 0 or self.log_every < 1:
            raise ValueError("TrainerConfig.eval_every must be >= 0 and log_every >= 1")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f"TrainerConfig.compile must be True, False or 'auto', got {self.compile!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"TrainerConfig.micro_batches must be an integer >= 1, got {self.micro_batches!r}")


class Trainer:
    """Drives one replica: ``await trainer.run()`` inside the caller's nursery."""

    def __init__(
        self,
        task: Task,
        strategy: OuterStrategy[object],
        config: TrainerConfig,
        *,
        device: DeviceInfo | None = None,
        checkpoints: CheckpointStore | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_round: Callable[[RoundCompleted], None] | None = None,
    ) -> None:
        self.task, self.strategy, self.config = task, strategy, config
        self.device = device or select_device()
        self.model = task.model.to(self.device.device)
        if config.activation_checkpointing:
            checkpoint_layers(self.model)
        self.forward = ForwardModule(self.model, compile=compile_enabled(config.compile, self.device.device))
        self.optimizer = task.optimizer or build_adamw(
            [p for p in self.model.parameters() if p.requires_grad],
            device=self.device.device,
            lr=config.schedule.lr,
            weight_decay=config.weight_decay,
        )
        # accounting; SPES freezes non-owned experts and drops their inner state
        strategy.attach_inner_optimizer(self.optimizer)
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.checkpoints = checkpoints
        self.checkpoint_writer = CheckpointWriter(checkpoints) if checkpoints is not None else None
        self.on_progress = on_progress or (lambda progress: None)
        self.on_round = on_round or (lambda event: None)
        self.step = 0
        self.tokens = 0
        self.bytes_sent = 0
        self.first_loss: float | None = None  # of the first progress report: how far the loss fell
        self._loss: torch.Tensor | None = None  # the last step's loss, left on the device
        self.last_val_loss: float | None = None  # of the current weights; None when unknown
        self._started: float | None = None
        self._seconds: float | None = None  # the run's wall time, once it ended
        self._window_tokens, self._window_start = 0, time.monotonic()
        self._rate = 0.0
        self._flops_per_token: float | None = None  # known from the first batch's length
        self._peak_flops = device_peak_flops(self.device)
        self._worker = WorkerStream(self.device.device)  # on CUDA the inner steps' own stream
        self._batches = self._new_batches(depth=0)  # drawn in the step's thread until ``run``
        self._done_in_thread: list[RoundCompleted] = []  # by the worker, recorded on trio
        # plain data that the caller keeps with every checkpoint (e.g. the daemon's history of
        # outer-state hashes); numbers, strings and containers only
        self.annotations: dict[str, Any] = {}

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> TrainingSummary:
        self._started, self._seconds = time.monotonic(), None
        try:
            with self._prefetching():
                async with trio.open_nursery() as nursery:
                    self.strategy.bind_nursery(nursery)
                    task_status.started()
                    while self.step < self.config.total_steps:
                        await self.train_step()
                    for report in await self.strategy.finish():
                        await self._round_done(report)
                    await self._evaluate_and_report()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # one failure (e.g. a ConfigError from the task) surfaces as itself
            if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
                raise group.exceptions[0] from None
            raise
        self._seconds = time.monotonic() - self._started
        return self.summary()

    @property
    def last_loss(self) -> float:
        """The last inner step's training loss (reading it waits for that step on the device)."""
        return float("nan") if self._loss is None else float(self._loss)

    def summary(self) -> TrainingSummary:
        """The run's figures as they stand now. A state adopted after ``run`` returned (a
        replica repaired onto the swarm's final state) changes the weights, and with them the
        validation loss: ``adopt_outer_state`` drops the old figure and ``revalidate`` measures
        the new one, so the summary always describes the weights this replica holds."""
        started = self._started if self._started is not None else time.monotonic()
        return TrainingSummary(
            steps=self.step,
            rounds=self.strategy.completed_rounds,
            train_loss=self.last_loss,
            val_loss=self.last_val_loss,
            tokens=self.tokens,
            seconds=self._seconds if self._seconds is not None else time.monotonic() - started,
            bytes_sent=self.bytes_sent,
            first_loss=self.first_loss,
        )

    async def train_step(self) -> None:
        """Inner steps up to the next sync, report or validation, then the strategy's turn."""
        if self.strategy.syncs_gradients:
            step = self.step + 1
            self._set_lr(step - 1)
            loss = await trio.to_thread.run_sync(self._worker.run, self._forward_backward)
            await self.strategy.before_optimizer_step(step)
            await trio.to_thread.run_sync(self._worker.run, self._optimizer_step)
            self.step, self._loss = step, loss
        else:
            await self._run_inner_steps(self._next_stop())
        done_in_thread, self._done_in_thread = self._done_in_thread, []
        for round_event in done_in_thread:
            await self._record_round(round_event)
        step = self.step
        for report in await self.strategy.after_inner_step(step):
            await self._round_done(report)
        if self.config.eval_every and step % self.config.eval_every == 0:
            await self._evaluate_and_report()
        elif step % self.config.log_every == 0:
            self._report()

    async def _run_inner_steps(self, last: int) -> None:
        """Inner steps up to ``last`` in the worker thread (on a node of several devices, by
        its rank processes: ``train/engine/ranks/``)."""
        await trio.to_thread.run_sync(self._worker.run, self._inner_steps, last)

    def device_status(self) -> dict[str, object]:
        """``lattica status``'s ``devices``: one entry per rank — here the one device."""
        entry: dict[str, object] = {"rank": 0, "device": self.device.describe(), "tokens_per_s": round(self._rate, 1)}
        if self.device.device.type == "cuda":
            entry["memory_bytes"] = torch.cuda.max_memory_allocated(self.device.device)
        utilization = mfu(self._flops_per_token, self._rate, self._peak_flops)
        if utilization is not None:
            entry["mfu"] = round(utilization, 4)
        return {"devices": [entry]}

    def _next_stop(self) -> int:
        """The next step after which the strategy or the trainer has work: a sync, a report or
        the end."""
        sync = self.strategy.next_sync_step(self.step)
        return self._own_stop() if sync is None else min(self._own_stop(), max(sync, self.step + 1))

    def _own_stop(self) -> int:
        """The next step after which the trainer itself needs the trio thread: a report, a
        validation or the end."""
        step, config = self.step, self.config
        stops = [config.total_steps, next_multiple(step, config.log_every)]
        if config.eval_every:
            stops.append(next_multiple(step, config.eval_every))
        return min(stops)

    def _inner_steps(self, last: int) -> None:
        """Worker thread: inner steps ``self.step + 1 ..`` up to the next step the trio thread
        must take (``last``, or later when the strategy syncs in this thread; stops early when
        cancelled)."""
        own_stop = self._own_stop()  # the trio thread takes it: the strategy's turn is there
        while self.step < last:
            trio.from_thread.check_cancelled()
            self._set_lr(self.step)
            self._loss = self._whole_step()
            self.step += 1
            if self.step == last < own_stop and self._sync_in_thread():
                last = self._next_stop()

    def _sync_in_thread(self) -> bool:
        """Worker thread, at a sync step: let the strategy do it here; False when the trio
        thread must take the step.

        Not with a checkpoint store: every completed round is checkpointed before the next
        inner step, on the trio thread. Rounds completed here are recorded, with the outer
        state of that moment, when the trio thread next takes a step.
        """
        if self.checkpoints is not None:
            return False
        reports = self.strategy.sync_in_thread(self.step)
        if reports is None:
            return False
        for report in reports:
            outer = None if report.skipped else self.strategy.outer_state_dict()
            self._done_in_thread.append(
                RoundCompleted(step=self.step, report=report, outer_state=outer)
            )
        return True

    def _set_lr(self, step: int) -> None:
        """The learning rate of inner step ``step + 1`` (the schedule counts from 0)."""
        factor = lr_multiplier(step, self.config.schedule)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = base * factor

    def _whole_step(self) -> torch.Tensor:
        loss = self._forward_backward()
        self._optimizer_step()
        return loss

    def _forward_backward(self) -> torch.Tensor:
        """Forward and backward of one step's batch; its loss, on the device."""
        x, y = self._next_batch()
        if self._flops_per_token is None and y.dim() >= 2:
            self._flops_per_token = model_flops_per_token(self.model, seq_len=y.shape[-1])
        self.model.train()
        loss = self.forward.run(lambda module: self._backward(module, x, y), on_retry=self._drop_gradients)
        self.tokens += y.numel()
        self._window_tokens += y.numel()
        return loss

    def _backward(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the batch's mean loss, in ``micro_batches`` parts (``inner_step``)."""
        return accumulate_gradients(
            lambda xs, ys: self._loss_of(module, xs, ys), x, y, self.config.micro_batches,
        )

    def _loss_of(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.device):
            loss = self.task.loss_fn(module, x, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError("the task's loss_fn must return a scalar tensor")
        return loss

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> None:
        if self.config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _next_batch(self) -> Batch:
        try:
            return self._batches.next()
        except BatchesEnded:
            raise ConfigError(f"the task's train_batches ran out at step {self.step + 1}") from None

    @contextlib.contextmanager
    def _prefetching(self) -> Iterator[None]:
        """For the length of ``run``: batches prepared on a background thread (``depth`` ahead,
        ``prefetch_depth``). Afterwards the sampler stands where the steps left it, not where
        the producer got to."""
        self._batches = self._new_batches(depth=prefetch_depth(self.device.device))
        try:
            yield
        finally:
            self._batches.close()
            if self.task.sampler is not None and self._batches.resume_state is not None:
                self.task.sampler.load_state_dict(self._batches.resume_state)
            self._batches = self._new_batches(depth=0)

    def _new_batches(self, *, depth: int) -> BatchPrefetcher:
        return BatchPrefetcher(self.task.train_batches, self.device.device, depth=depth, sampler=self.task.sampler)

    # ------------------------------------------------------------------ rounds, evaluation

    async def _round_done(self, report: OuterStepReport) -> None:
        outer = None
        if not report.skipped:
            outer = self.strategy.outer_state_dict()  # a copy: later rounds do not change it
        await self._record_round(RoundCompleted(step=self.step, report=report, outer_state=outer))

    async def _record_round(self, event: RoundCompleted) -> None:
        self.bytes_sent += event.report.bytes_sent
        if event.outer_state is not None:
            # written before the next inner step, in a thread: the event loop (syncs in
            # flight, peers fetching state) keeps running during serialization and fsync
            await self.save_checkpoint()
        self.on_round(event)

    async def save_checkpoint(self) -> None:
        """Checkpoint the state held now, if there is a store. A full disk does not stop
        training: ``checkpoint_writer`` reports it once and tries again later."""
        if self.checkpoint_writer is not None:
            await self.checkpoint_writer.save(self.state_dict)

    async def checkpoint_until_written(self) -> None:
        """After the run: while the last checkpoint could not be written, keep trying. Each
        attempt writes a copy: a state adopted meanwhile (``revalidate``'s caller) changes the
        weights on the trio thread while the worker thread serializes."""
        if self.checkpoint_writer is not None:
            await self.checkpoint_writer.until_written(lambda: copy.deepcopy(self.state_dict()))

    async def _evaluate_and_report(self) -> None:
        if self.task.val_batches:
            self.last_val_loss = await trio.to_thread.run_sync(self.evaluate)
        self._report(val_loss=self.last_val_loss)

    async def revalidate(self) -> float | None:
        """Validate the weights held now and report it (``on_progress``): after a state was
        adopted once the run had ended, the last validation was of the weights it replaced."""
        await self._evaluate_and_report()
        return self.last_val_loss

    def evaluate(self) -> float:
        """Mean validation loss (blocking; on the strategy's evaluation weights if it has any)."""
        weights = self.strategy.evaluation_parameters()
        return mean_validation_loss(self.model, self.task, self.device, weights=weights)

    def _report(self, val_loss: float | None = None) -> None:
        loss = self.last_loss  # waits for the steps queued on the device: the rate counts them
        now = time.monotonic()
        if self._window_tokens:  # otherwise repeat the last measured rate
            self._rate = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_tokens, self._window_start = 0, now
        if self.first_loss is None and math.isfinite(loss):
            self.first_loss = loss
        self.on_progress(
            Progress(
                step=self.step,
                round=self.strategy.completed_rounds,
                loss=loss,
                tokens_per_s=self._rate,
                lr=self.optimizer.param_groups[0]["lr"],
                val_loss=val_loss,
                mfu=mfu(self._flops_per_token, self._rate, self._peak_flops),
            )
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> StateDict:
        """Everything a restarted peer needs to resume: weights, optimizers, step, sampler."""
        state: StateDict = {
            "step": self.step,
            "tokens": self.tokens,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "outer": self.strategy.outer_state_dict(),
            "annotations": dict(self.annotations),
        }
        if self.task.sampler is not None:  # where the steps left it (the producer is further on)
            state["sampler"] = self._batches.resume_state
        return state

    def load_state_dict(self, state: StateDict) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.strategy.load_outer_state_dict(state["outer"])
            if self.task.sampler is not None and "sampler" in state:
                self._batches.close()
                self.task.sampler.load_state_dict(state["sampler"])
                self._batches = self._new_batches(depth=self._batches.depth)
            self.step = int(state["step"])
            self.tokens = int(state.get("tokens", 0))
            annotations = state.get("annotations", {})
            self.annotations = dict(annotations) if isinstance(annotations, dict) else {}
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(f"checkpoint does not fit this model/strategy: {exc}") from None

    def resume(self) -> bool:
        """Load the newest local checkpoint, if any; True when training resumes from it."""
        if self.checkpoints is None:
            return False
        state = self.checkpoints.load_latest()
        if state is None:
            return False
        self.load_state_dict(state)
        log.info("resumed at step %d", self.step)
        return True

    def adopt_outer_state(
        self, outer: StateDict, *, step: int | None = None, check: Callable[[], None] = lambda: None,
    ) -> None:
        """Join a running swarm: take the fetched outer state and continue from its step.

        ``step`` defaults to the inner step recorded in the outer state (``outer["step"]``), so
        the joiner takes part from the next round with the right learning rate.

        All or nothing: when loading raises, or ``check`` (called with the state loaded: the
        strategy's counters are the adopted ones) raises, the outer state, weights and step of
        before are put back and the error propagates.
        """
        before = self.strategy.outer_state_dict(), _copy_of_weights(self.model), self.step
        try:
            self.strategy.load_outer_state_dict(outer)
            self.step = int(outer.get("step", 0)) if step is None else step
            check()
        except Exception:
            self._put_back(*before)
            raise
        # the weights changed: the last validation loss was of the replaced ones (the next
        # validation, or ``revalidate`` once the run has ended, measures these)
        self.last_val_loss = None

    def _put_back(self, outer: StateDict, weights: dict[str, torch.Tensor], step: int) -> None:
        self.strategy.load_outer_state_dict(outer)
        self.model.load_state_dict(weights)
        self.step = step


def _copy_of_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

