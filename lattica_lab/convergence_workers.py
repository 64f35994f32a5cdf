"""The workers of the convergence benchmark: N in-process replicas training one method.

``run_method`` builds ``workers`` replicas of a ``Method``'s model from identical weights (the
seed's fresh ones, or ``initial``: ``warm_start``'s shared pretraining), gives each its own
shard of the train stream and its own ``Trainer`` with the method's strategy, and runs them
concurrently in one trio run. They talk only through an ``InMemoryCollectiveGroup``, whose
per-member byte counter counts what a butterfly all-reduce really sends; groups are fixed (every
worker, ``FixedGroups``). Each replica is then evaluated on the same validation batches.

A method finishes when every worker trained the full budget and ended with a finite validation
loss (``finished_losses``); otherwise ``BenchmarkFailed`` names it and the workers, and the
benchmark reports no figures. ``run_timed`` runs one method and adds its wall time;
``run_measured`` does the same in a forked child and adds its peak resident memory per worker.

The benchmark's command line, its table of methods and its JSON summary stay in
``benchmarks/convergence.py``.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from lattica.train.engine.data import BatchConfig, BatchSampler, validation_batches
from lattica.train.engine.device import select_device
from lattica.train.engine.model import build_model, lm_loss
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies import create_strategy
from lattica.train.strategies.accounting import optimizer_state_bytes
from lattica.train.strategies.ddp import DDPConfig
from lattica_lab.collective import InMemoryCollectiveGroup

WORKERS = 4  # the default number of workers
WARM_SEED_OFFSET = 7919  # the pretraining draws its own batches, not worker 0's


def tiny_model(seed: int) -> torch.nn.Module:
    """The byte-level ``tiny`` GPT, the model every method trains unless it names its own."""
    return build_model("tiny", seed=seed)


@dataclass(frozen=True, kw_only=True)
class Method:
    """One benchmarked method: a registered strategy, its config and (optionally) its model."""

    strategy: str
    config: Any = None
    build_model: Callable[[int], torch.nn.Module] = tiny_model
    evaluate_average: bool = False  # also report the loss of the replicas' averaged weights


def peers_of(workers: int) -> tuple[str, ...]:
    """The workers' names in the collective: ``worker-0`` …"""
    return tuple(f"worker-{i}" for i in range(workers))


class BenchmarkFailed(RuntimeError):
    """A method did not finish: the benchmark reports no figures."""


def finished_losses(name: str, summaries: dict, steps: int, workers: int = WORKERS) -> list[float]:
    """Every worker's validation loss, when all of them trained ``steps`` steps and ended with a
    finite loss; else ``BenchmarkFailed`` naming the method and the workers."""
    bad = []
    for i in range(workers):
        summary = summaries.get(i)
        if summary is None:
            bad.append(f"worker {i} did not report")
        elif summary.steps != steps:
            bad.append(f"worker {i} trained {summary.steps} of {steps} steps")
        elif summary.val_loss is None or not math.isfinite(summary.val_loss):
            bad.append(f"worker {i} ended with validation loss {summary.val_loss}")
    if bad:
        raise BenchmarkFailed(f"{name} did not finish: {'; '.join(bad)}")
    return [summaries[i].val_loss for i in range(workers)]


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What every method gets: the same inner steps, batch shape, inner schedule and evaluation."""

    steps: int = 500
    batch_size: int = 8
    context: int = 128
    lr: float = 3e-3
    warmup: int = 50
    eval_batches: int = 16
    device: str = "cpu"  # where the workers train: cpu or cuda
    compile: bool | str = "auto"  # the trainers' torch.compile setting (auto: on CUDA)


class FixedGroups:
    """Every averaging group is the same: all the workers."""

    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = members

    async def group_for(self, key: str) -> tuple[str, ...]:
        return self.members


async def warm_start(
    build: Callable[[int], torch.nn.Module], corpus, budget: Budget, seed: int, steps: int
) -> dict[str, torch.Tensor]:
    """Weights after ``steps`` steps of ordinary single-worker training on the whole train stream.

    Every method then starts from these same weights: the shared pretrained checkpoint that the
    DiLoCo paper's main experiments start from. The run is the trainer with the ``nocomm``
    strategy (plain AdamW, warmup + cosine over ``steps``), the same batch shape as the methods.
    """
    model = build(seed)
    sampler = BatchSampler(
        corpus.train,
        BatchConfig(
            batch_size=budget.batch_size, context=budget.context, seed=seed + WARM_SEED_OFFSET
        ),
    )
    device = select_device(budget.device)
    model.to(device.device)
    task = Task(model=model, train_batches=iter(sampler), val_batches=[], sampler=sampler)
    strategy = create_strategy(
        "nocomm", model, collective=InMemoryCollectiveGroup(("warm",)).member("warm"),
        groups=FixedGroups(("warm",)),
    )
    config = TrainerConfig(
        total_steps=steps,
        eval_every=0,
        log_every=steps,
        schedule=ScheduleConfig(lr=budget.lr, warmup_steps=budget.warmup, total_steps=steps),
        compile=budget.compile,  # type: ignore[arg-type]
    )
    await Trainer(task, strategy, config, device=device).run()
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}


async def run_method(
    name: str,
    method: Method,
    corpus,
    budget: Budget,
    seed: int,
    initial: dict[str, torch.Tensor] | None = None,
    workers: int = WORKERS,
) -> dict[str, float]:
    """Train ``method`` on ``workers`` workers from ``initial`` (else from the seed's fresh weights)."""
    peers = peers_of(workers)
    peaks = [0] * workers
    network = InMemoryCollectiveGroup(peers)
    val = validation_batches(
        corpus.val,
        batch_size=budget.batch_size,
        context=budget.context,
        max_batches=budget.eval_batches,
    )
    device = select_device(budget.device)
    config_of_method = method.config
    if method.strategy == "ddp" and device.device.type != "cpu":  # gradients averaged on the device
        config_of_method = DDPConfig(reduce_on_device=True)
    trainers = []
    for i, peer in enumerate(peers):
        sampler = BatchSampler(
            corpus.train,
            BatchConfig(
                batch_size=budget.batch_size,
                context=budget.context,
                seed=seed,
                shard_index=i,
                num_shards=workers,
            ),
        )
        model = method.build_model(seed)
        if initial is not None:
            model.load_state_dict(initial)
        model.to(device.device)  # before the strategy: it places its outer state for this device
        task = Task(model=model, train_batches=iter(sampler), val_batches=val, sampler=sampler)
        strategy = create_strategy(
            method.strategy,
            model,
            collective=network.member(peer),
            groups=FixedGroups(peers),
            config=config_of_method,
        )
        config = TrainerConfig(
            total_steps=budget.steps,
            eval_every=0,
            log_every=budget.steps,
            schedule=ScheduleConfig(
                lr=budget.lr, warmup_steps=budget.warmup, total_steps=budget.steps
            ),
            compile=budget.compile,  # type: ignore[arg-type]
        )

        def track_peak(event, i=i) -> None:
            peaks[i] = max(peaks[i], event.report.bytes_sent)

        trainers.append(
            Trainer(task, strategy, config, device=device, on_round=track_peak)
        )
    summaries = {}

    async def train(i: int) -> None:
        summaries[i] = await trainers[i].run()

    async with trio.open_nursery() as nursery:
        for i in range(workers):
            nursery.start_soon(train, i)
    losses = finished_losses(name, summaries, budget.steps, workers)
    result = {
        "loss": statistics.fmean(losses),
        "loss_spread": max(losses) - min(losses),
        "bytes": statistics.fmean(network.bytes_sent.values()),
        "peak_sync_bytes": statistics.fmean(peaks),
        "optimizer_state_bytes": statistics.fmean(
            optimizer_state_bytes(t.optimizer) + _outer_state_bytes(t.strategy) for t in trainers
        ),
    }
    if method.evaluate_average:
        result["avg_weights_loss"] = _averaged_weights_loss([t.model for t in trainers], val)
    return result


def _outer_state_bytes(strategy) -> int:
    """The strategy's own state: its figure if it reports one, else its outer state's tensors."""
    reported = getattr(strategy, "outer_state_bytes", None)
    if reported is not None:
        return int(reported)
    return _tensor_bytes(strategy.outer_state_dict())


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _averaged_weights_loss(models: list[torch.nn.Module], val) -> float:
    """Validation loss of the element-wise mean of the replicas' weights."""
    average = models[0]
    with torch.no_grad():
        for params in zip(*(m.parameters() for m in models), strict=True):
            params[0].copy_(torch.stack([p.detach() for p in params]).mean(dim=0))
        average.eval()
        device = next(average.parameters()).device
        losses = [float(lm_loss(average(x.to(device)), y.to(device))) for x, y in val]
    return statistics.fmean(losses)


def run_timed(
    name: str, method: Method, corpus, budget: Budget, seed: int, initial, workers: int = WORKERS
) -> dict[str, float]:
    started = time.monotonic()
    try:
        result = trio.run(run_method, name, method, corpus, budget, seed, initial, workers)
    except BenchmarkFailed:
        raise
    except Exception as exc:  # a method that crashes is a method that did not finish
        raise BenchmarkFailed(f"{name} did not finish: {type(exc).__name__}: {exc}") from exc
    result["seconds"] = time.monotonic() - started
    return result


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_measured(
    name: str, method: Method, corpus, budget: Budget, seed: int, initial, workers: int = WORKERS
) -> dict[str, float]:
    """``run_timed`` in a forked child, with ``peak_memory_bytes``: the child's peak resident memory
    above its resident memory right after the fork (the peak reset through ``clear_refs``), per
    worker. A child per method: memory freed by one method and kept by the allocator would
    hide the next method's growth."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM ← VmRSS
            base = _resident_kib("VmRSS")
            result = run_timed(name, method, corpus, budget, seed, initial, workers)
            result["peak_memory_bytes"] = (_resident_kib("VmHWM") - base) * 1024 / workers
            send.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent as a failed method
            send.send(("failed", str(exc)))

    process = context.Process(target=child)
    process.start()
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "failed", f"{name} did not finish: its process exited with no result"
    process.join()
    if status != "ok":
        raise BenchmarkFailed(payload)
    return payload
