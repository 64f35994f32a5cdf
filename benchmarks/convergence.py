"""Convergence vs communication: DDP, no communication and DiLoCo on a tiny byte-level GPT.

Four in-process workers start from identical weights and each trains on its own shard of the
corpus with the same token budget for every method. Communication goes through the in-memory
collective, whose per-worker byte counter counts what a butterfly all-reduce really sends
(2 (N-1)/N of the fp32 payload per sync). Validation loss is in nats per byte: the mean over the
workers' replicas, evaluated on each strategy's evaluation weights.

Adding a method: register its strategy in ``lattica.train.strategies.STRATEGIES`` and add a
``Method`` to ``METHODS`` (its own model builder and config if it needs them); the JSON line
then carries ``<name>_loss``, ``<name>_bytes`` and ``<name>_vs_ddp``.

    python benchmarks/convergence.py [--data PATH] [--strategies ddp,nocomm,diloco] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from lattica.errors import ConfigError
from lattica.testing.collective import InMemoryCollectiveGroup
from lattica.train.data import (
    BatchConfig,
    BatchSampler,
    DataConfig,
    load_corpus,
    validation_batches,
)
from lattica.train.device import select_device
from lattica.train.model import build_model
from lattica.train.schedule import ScheduleConfig
from lattica.train.strategies import create_strategy
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica.train.task import Task
from lattica.train.trainer import Trainer, TrainerConfig

WORKERS = 4


@dataclass(frozen=True, kw_only=True)
class Method:
    """One benchmarked method: a registered strategy, its config and (optionally) its model."""

    strategy: str
    config: Any = None
    build_model: Callable[[int], torch.nn.Module] = field(
        default=lambda seed: build_model("tiny", seed=seed)
    )


METHODS: dict[str, Method] = {
    "ddp": Method(strategy="ddp"),
    "nocomm": Method(strategy="nocomm"),
    "diloco": Method(strategy="diloco", config=DiLoCoConfig(inner_steps=50)),
}


@dataclass(frozen=True, kw_only=True)
class Budget:
    steps: int = 500
    batch_size: int = 8
    context: int = 128
    lr: float = 3e-3
    warmup: int = 50
    eval_batches: int = 16


class FixedGroups:
    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = members

    async def group_for(self, key: str) -> tuple[str, ...]:
        return self.members


async def run_method(name: str, corpus, budget: Budget, seed: int) -> dict[str, float]:
    method = METHODS[name]
    peers = tuple(f"worker-{i}" for i in range(WORKERS))
    network = InMemoryCollectiveGroup(peers)
    val = validation_batches(
        corpus.val,
        batch_size=budget.batch_size,
        context=budget.context,
        max_batches=budget.eval_batches,
    )
    trainers = []
    for i, peer in enumerate(peers):
        sampler = BatchSampler(
            corpus.train,
            BatchConfig(
                batch_size=budget.batch_size,
                context=budget.context,
                seed=seed,
                shard_index=i,
                num_shards=WORKERS,
            ),
        )
        model = method.build_model(seed)
        task = Task(model=model, train_batches=iter(sampler), val_batches=val, sampler=sampler)
        strategy = create_strategy(
            method.strategy,
            model,
            collective=network.member(peer),
            groups=FixedGroups(peers),
            config=method.config,
        )
        config = TrainerConfig(
            total_steps=budget.steps,
            eval_every=0,
            log_every=budget.steps,
            schedule=ScheduleConfig(
                lr=budget.lr, warmup_steps=budget.warmup, total_steps=budget.steps
            ),
        )
        trainers.append(Trainer(task, strategy, config, device=select_device("cpu")))
    summaries = {}

    async def train(i: int) -> None:
        summaries[i] = await trainers[i].run()

    async with trio.open_nursery() as nursery:
        for i in range(WORKERS):
            nursery.start_soon(train, i)
    losses = [summaries[i].val_loss for i in range(WORKERS)]
    return {
        "loss": statistics.fmean(losses),
        "loss_spread": max(losses) - min(losses),
        "bytes": statistics.fmean(network.bytes_sent.values()),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="stdlib", help="text file/folder/JSONL/.bin (default: stdlib)"
    )
    parser.add_argument("--strategies", default="ddp,nocomm,diloco")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Budget.steps, help="inner steps per worker")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per operation")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        print(f"error: unknown strategies {unknown}; known: {sorted(METHODS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    budget = Budget(steps=args.steps)
    try:
        corpus = load_corpus(DataConfig(source=args.data))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = WORKERS * budget.steps * budget.batch_size * budget.context
    print(f"data: {corpus.description} (sha256 {corpus.content_hash[:12]})")
    print(
        f"{WORKERS} workers x {budget.steps} steps x {budget.batch_size}x{budget.context} "
        f"tokens = {tokens} tokens per method, seed {args.seed}"
    )
    results: dict[str, dict[str, float]] = {}
    for name in names:
        started = time.monotonic()
        results[name] = trio.run(run_method, name, corpus, budget, args.seed)
        results[name]["seconds"] = time.monotonic() - started
    print(f"{'method':<12}{'val loss':>10}{'spread':>9}{'MB sent/worker':>16}{'seconds':>9}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['loss']:>10.4f}{r['loss_spread']:>9.4f}"
            f"{r['bytes'] / 1e6:>16.2f}{r['seconds']:>9.1f}"
        )
    print(json.dumps(summary_json(results, args.seed, tokens)))
    return 0


def summary_json(results: dict[str, dict[str, float]], seed: int, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"seed": seed, "tokens_per_method": tokens, "workers": WORKERS}
    for name, r in results.items():
        out[f"{name}_loss"] = round(r["loss"], 5)
        out[f"{name}_bytes"] = int(r["bytes"])
    ddp = results.get("ddp")
    for name, r in results.items():
        if ddp is not None and name != "ddp":
            out[f"{name}_vs_ddp"] = round(r["loss"] / ddp["loss"], 5)
            if r["bytes"]:
                out[f"ddp_bytes_vs_{name}"] = round(ddp["bytes"] / r["bytes"], 2)
    return out


if __name__ == "__main__":
    sys.exit(main())
