"""Inner-step throughput: the product's ``Trainer`` against the best plain PyTorch loop.

For each preset the same model (same seed) is trained twice in one process, in turns:

- the product: ``Trainer`` with the ``nocomm`` strategy on synthetic tokens (an iterator of CPU
  batches, as a task yields them: the trainer copies them to the device itself), with the
  device's default settings (``compile = "auto"``, fused AdamW, batches prepared ahead on CUDA);
- the plain loop: forward under the same autocast, cross-entropy, backward, the same gradient
  clipping, ``torch.optim.AdamW(fused=True)``, ``zero_grad(set_to_none=True)`` — compiled when
  the trainer compiles, its batches already on the device, nothing else.

Both run the same number of warm-up steps (compilation happens there), then ``--reps`` timed
chunks of ``--steps`` steps each, interleaved: a trainer chunk, then a plain chunk, so load on
a shared machine hits both alike (short chunks, many reps: load that drifts within seconds
still does). Each chunk ends by waiting for the device (the trainer's
report reads its loss; the plain loop reads its last loss). Tokens per second are each side's
median over the reps.

Also per preset: ``mfu`` (model FLOPs utilisation of the trainer, ``lattica.train.engine.utilization``;
null on the CPU and on devices of unknown peak), ``peak_memory_bytes`` (CUDA: the allocator's
peak during the trainer's timed chunks; CPU: the process's peak resident memory then — both
include the plain loop's resident model) and ``outer_extra_device_bytes``: the device memory a
DiLoCo strategy with the default outer-state placement adds to the trained model, through one
outer round (CUDA: the allocator's peak above what was allocated before; CPU: the outer state
itself, since there the device's memory is the host's).

    python benchmarks/throughput.py [--presets tiny,mini] [--device auto|cpu|cuda]
        [--compile auto|true|false] [--steps 10] [--warmup 20] [--reps 9]
        [--batch-size N] [--seq-len N] [--devices cpu:2 | cuda:0,cuda:1 | auto]

``--devices`` adds, per preset, a node of several ranks (``train.devices``: one rank process
per device, DDP inside, through the daemon's own trainer factory) against a node of one rank
on the first of those devices, each rank given the preset's batch (the node's batch is N ×
that): ``multi_vs_single`` = the N-rank node's tokens/s ÷ (N × the one-rank node's), the
medians of ``--reps`` chunks of ``--steps`` steps after the warm-up. On the CPU a rank is a
share of the cores (the one-rank node gets the same share), so the figure is bounded by the
machine's cores; with NCCL on a multi-GPU machine the target is >= 0.9.

Last line: one JSON object ``{"device", "compile", "presets": {name: {...}}, ...}``. A phase that
did not finish (an error, a trainer that did not train all its steps, a missing rep, a
non-finite loss) fails the run: exit status 1, one line on stderr, no figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)
import torch
import trio

from lattica.train.engine.compiled_model import compile_enabled
from lattica.train.engine.device import DeviceInfo, autocast, select_device
from lattica.train.engine.inner_optimizer import BETAS, adamw_implementation
from lattica.train.engine.model import GPTConfig, build_model, lm_loss, preset
from lattica.train.engine.reports import Progress
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.engine.utilization import device_peak_flops, mfu, model_flops_per_token
from lattica.train.strategies import create_strategy
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

# batch x sequence length per preset (the shapes for the GPU presets)
SHAPES: dict[str, tuple[int, int]] = {
    "tiny": (16, 128),
    "mini": (16, 256),
    "small": (32, 256),
    "medium": (64, 512),
    "gpt2-124m": (32, 1024),
    "gpt-125m": (32, 1024),
    "gpt-350m": (16, 1024),
}
LR, WEIGHT_DECAY, GRAD_CLIP = 3e-4, 0.1, 1.0
SYNTHETIC_BATCHES = 8  # distinct batches, cycled
SEED = 0


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


class FixedGroups:
    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = members

    async def group_for(self, key: str) -> tuple[str, ...]:
        return self.members


@dataclass(frozen=True, kw_only=True)
class Run:
    device: DeviceInfo
    compile: bool
    steps: int
    warmup_chunks: int
    reps: int


@dataclass
class Timings:
    trainer_s: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0


def synthetic_batches(
    batch: int, seq_len: int, vocab: int, count: int = SYNTHETIC_BATCHES
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class PlainLoop:
    """The best plain loop for the model (module docstring)."""

    def __init__(self, config: GPTConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], run: Run) -> None:
        self.device = run.device
        self.model = build_model(config, seed=SEED).to(run.device.device)
        self.forward = torch.compile(self.model) if run.compile else self.model
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
            **adamw_implementation(run.device.device),
        )
        self.batches = [(x.to(run.device.device), y.to(run.device.device)) for x, y in batches]
        self._next = 0

    def train(self, steps: int) -> float:
        """``steps`` steps; the last loss (reading it waits for the device)."""
        loss = None
        for _ in range(steps):
            x, y = self.batches[self._next % len(self.batches)]
            self._next += 1
            with autocast(self.device):
                loss = lm_loss(self.forward(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        assert loss is not None
        return float(loss.detach())


class PeakMemory:
    """The training process's peak memory over a span (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None

    def reset(self) -> None:
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        elif Path("/proc/self/clear_refs").exists():
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM <- VmRSS

    def peak(self) -> int:
        if self.cuda is not None:
            return int(torch.cuda.max_memory_allocated(self.cuda))
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


def measure_preset(name: str, batch: int, seq_len: int, run: Run) -> dict[str, Any]:
    config = preset(name)
    if seq_len > config.context:
        raise BenchmarkFailed(f"{name}: --seq-len {seq_len} exceeds the preset's context {config.context}")
    batches = synthetic_batches(batch, seq_len, config.vocab_size)
    plain = PlainLoop(config, batches, run)
    timings = trio.run(_interleaved, config, batches, plain, run)
    trainer_tps = batch * seq_len * run.steps / statistics.median(timings.trainer_s)
    plain_tps = batch * seq_len * run.steps / statistics.median(timings.plain_s)
    model = plain.model
    del plain
    return {
        "trainer_tokens_per_s": round(trainer_tps, 1),
        "plain_tokens_per_s": round(plain_tps, 1),
        "trainer_vs_plain": round(trainer_tps / plain_tps, 4),
        "mfu": _rounded(mfu(model_flops_per_token(model, seq_len), trainer_tps, device_peak_flops(run.device))),
        "peak_memory_bytes": timings.peak_memory_bytes,
        "outer_extra_device_bytes": outer_extra_device_bytes(model, run.device.device),
        "batch_size": batch,
        "seq_len": seq_len,
        "trainer_s": [round(t, 4) for t in timings.trainer_s],
        "plain_s": [round(t, 4) for t in timings.plain_s],
    }


async def _interleaved(
    config: GPTConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], plain: PlainLoop, run: Run,
) -> Timings:
    """The trainer's chunks with a plain chunk after each (inside its progress report)."""
    chunks = run.warmup_chunks + run.reps
    total = chunks * run.steps
    model = build_model(config, seed=SEED)
    task = Task(model=model, train_batches=itertools.cycle(batches))
    strategy = create_strategy(
        "nocomm", model, collective=InMemoryCollectiveGroup(("me",)).member("me"), groups=FixedGroups(("me",)),
    )
    trainer_config = TrainerConfig(
        total_steps=total, eval_every=0, log_every=run.steps, grad_clip=GRAD_CLIP, weight_decay=WEIGHT_DECAY,
        schedule=ScheduleConfig(lr=LR, warmup_steps=0, total_steps=total), compile=run.compile,
    )
    timings, memory, seen = Timings(), PeakMemory(run.device.device), set()
    mark = time.perf_counter()

    def after_chunk(progress: Progress) -> None:
        nonlocal mark
        if progress.step in seen or progress.step % run.steps:
            return  # the report repeated at the end of the run
        seen.add(progress.step)
        trainer_s = time.perf_counter() - mark
        timed = progress.step // run.steps > run.warmup_chunks
        if not math.isfinite(progress.loss):
            raise BenchmarkFailed(f"the trainer's loss is {progress.loss} at step {progress.step}")
        if timed:
            timings.trainer_s.append(trainer_s)
            timings.peak_memory_bytes = max(timings.peak_memory_bytes, memory.peak())
        started = time.perf_counter()
        loss = plain.train(run.steps)
        if not math.isfinite(loss):
            raise BenchmarkFailed(f"the plain loop's loss is {loss}")
        if timed:
            timings.plain_s.append(time.perf_counter() - started)
        memory.reset()
        mark = time.perf_counter()

    trainer = Trainer(task, strategy, trainer_config, device=run.device, on_progress=after_chunk)
    if trainer.forward.compiled != run.compile:
        raise BenchmarkFailed(f"the trainer compiles: {trainer.forward.compiled}, the plain loop: {run.compile}")
    summary = await trainer.run()
    if summary.steps != total:
        raise BenchmarkFailed(f"the trainer trained {summary.steps} of {total} steps")
    if trainer.forward.compiled != run.compile:
        raise BenchmarkFailed("torch.compile failed in the trainer (it fell back to eager): not comparable")
    if len(timings.trainer_s) != run.reps or len(timings.plain_s) != run.reps:
        raise BenchmarkFailed(f"{len(timings.trainer_s)} trainer and {len(timings.plain_s)} plain reps of {run.reps}")
    return timings


def measure_ranks(name: str, batch: int, seq_len: int, devices: str, run: Run) -> dict[str, Any]:
    """``multi_vs_single`` of the preset (module docstring)."""
    from lattica.train.engine.ranks.devices import resolve_devices
    from lattica.train.engine.ranks.group import threads_per_rank

    node = resolve_devices(devices, "auto")
    if node.ranks < 2:
        raise BenchmarkFailed(f"--devices {devices} is one device here: nothing to compare")
    one = node.names[0] if node.kind == "cuda" else "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(node.names))  # the one-rank node gets one rank's share
    try:
        single = _node_tokens_per_s(name, batch, seq_len, one, run)
    finally:
        torch.set_num_threads(threads)
    multi = _node_tokens_per_s(name, batch * node.ranks, seq_len, devices, run)
    return {
        "devices": list(node.names), "ranks": node.ranks, "per_rank_batch": batch, "seq_len": seq_len,
        "single_tokens_per_s": round(single, 1), "multi_tokens_per_s": round(multi, 1),
        "multi_vs_single": round(multi / (node.ranks * single), 4),
    }


def _node_tokens_per_s(name: str, batch: int, seq_len: int, devices: str, run: Run) -> float:
    """The median tokens/s of a node's timed chunks, trained as the daemon trains (nocomm)."""
    from lattica.config import TrainSettings
    from lattica.train.settings import trainer_factory

    chunks = run.warmup_chunks + run.reps
    settings = TrainSettings(
        strategy="nocomm", model=name, inner_steps=run.steps, rounds=chunks, batch_size=batch, seq_len=seq_len,
        device="cuda" if devices.startswith("cuda") else "cpu", devices=devices, warmup_steps=0,
        compile=run.compile,
    )
    rates: list[float] = []
    seen: set[int] = set()

    def timed(progress: Progress) -> None:
        warm = progress.step > run.warmup_chunks * run.steps
        if progress.step % run.steps == 0 and warm and progress.step not in seen:
            seen.add(progress.step)
            rates.append(progress.tokens_per_s)

    with tempfile.TemporaryDirectory(prefix="lattica-throughput-") as tmp:
        parts = trainer_factory.TrainerParts(
            peer_id="me", collective=InMemoryCollectiveGroup(("me",)).member("me"), groups=FixedGroups(("me",)),
            checkpoint_dir=Path(tmp), on_progress=timed,
        )
        trainer = trainer_factory.build_trainer(settings, parts)
        trainer.checkpoints = trainer.checkpoint_writer = None  # nothing on disk inside the timing
        trainer.task.val_batches = ()  # no validation inside a timed window
        summary = trio.run(trainer.run)
    if summary.steps != chunks * run.steps or len(rates) != run.reps:
        raise BenchmarkFailed(f"{devices}: {summary.steps} steps, {len(rates)} of {run.reps} timed chunks")
    if not math.isfinite(summary.train_loss):
        raise BenchmarkFailed(f"{devices}: the loss is {summary.train_loss}")
    return statistics.median(rates)


def outer_extra_device_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """The device memory a DiLoCo strategy (default placement) adds through one outer round."""
    member = InMemoryCollectiveGroup(("me",)).member("me")
    if device.type != "cuda":
        strategy = DiLoCo(model, collective=member, groups=FixedGroups(("me",)), config=DiLoCoConfig(inner_steps=1))
        trio.run(strategy.sync)
        return int(strategy.outer_state_bytes)  # on the CPU the outer state shares the device's memory
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    strategy = DiLoCo(model, collective=member, groups=FixedGroups(("me",)), config=DiLoCoConfig(inner_steps=1))
    trio.run(strategy.sync)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,mini", help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--compile", default="auto", choices=("auto", "true", "false"),
                        help="for both sides (default: the device's default, as the trainer's)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed chunk (the daemon reports every 10)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps (rounded up to whole chunks)")
    parser.add_argument("--reps", type=int, default=9, help="timed chunks per side, interleaved")
    parser.add_argument("--batch-size", type=int, help="instead of the preset's (SHAPES)")
    parser.add_argument("--seq-len", type=int, help="instead of the preset's (SHAPES)")
    parser.add_argument("--devices", help="also a node of these devices against one of them: multi_vs_single")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        print(f"error: unknown presets {unknown}; known: {sorted(SHAPES)}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.reps < 1 or args.warmup < 0:
        print("error: --steps and --reps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    device = select_device(args.device)
    setting: bool | str = {"true": True, "false": False}.get(args.compile, "auto")
    run = Run(
        device=device, compile=compile_enabled(setting, device.device),  # type: ignore[arg-type]
        steps=args.steps, warmup_chunks=max(1, math.ceil(args.warmup / args.steps)), reps=args.reps,
    )
    load_before = _load()
    print(f"device: {device.describe()}, compile: {run.compile}, {run.reps} reps of {run.steps} steps "
          f"after {run.warmup_chunks * run.steps} warm-up steps, torch threads {torch.get_num_threads()}")
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            batch, seq_len = SHAPES[name]
            results[name] = measure_preset(name, args.batch_size or batch, args.seq_len or seq_len, run)
            if args.devices:
                results[name]["ranks"] = measure_ranks(
                    name, args.batch_size or batch, args.seq_len or seq_len, args.devices, run,
                )
    except BenchmarkFailed as exc:
        print(f"throughput benchmark failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a phase that crashes is a phase that did not finish
        print(f"throughput benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"{'preset':<12}{'batch x seq':>13}{'trainer tok/s':>15}{'plain tok/s':>13}{'ratio':>8}{'mfu':>8}")
    for name, r in results.items():
        shown_mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        print(f"{name:<12}{r['batch_size']:>6} x {r['seq_len']:<5}{r['trainer_tokens_per_s']:>15.0f}"
              f"{r['plain_tokens_per_s']:>13.0f}{r['trainer_vs_plain']:>8.3f}{shown_mfu:>8}")
    summary = {
        "device": device.describe(),
        "compile": run.compile,
        "presets": results,
        "steps": run.steps,
        "reps": run.reps,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": [load_before, _load()],
    }
    multi = {n: r["ranks"]["multi_vs_single"] for n, r in results.items() if "ranks" in r}
    if multi:
        print("multi_vs_single: " + ", ".join(f"{n} {v:.3f}" for n, v in multi.items()))
        summary["multi_vs_single"] = min(multi.values())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
