"""Convergence vs communication: DDP, no communication and DiLoCo on a tiny byte-level GPT.

Four in-process workers (``--workers N``) start from identical weights and each trains on its own shard of the
corpus with the same token budget for every method. By default those are the seed's fresh
weights. With ``--warm-start-steps N`` they come from a shared pretraining of N steps (ordinary
single-worker training on the whole train stream), the setting of the DiLoCo paper's main
experiments; DDP and DiLoCo are then also compared from fresh weights (``scratch_*`` keys), so
both regimes are on record in the same run. Communication goes through the in-memory
collective, whose per-worker byte counter counts what a butterfly all-reduce really sends
(2 (N-1)/N of the fp32 payload per sync). Validation loss is in nats per byte: the mean over the
workers' replicas, evaluated on each strategy's evaluation weights.

``--model`` trains another built-in preset instead of the byte-level ``tiny`` (``llama-tiny`` …;
the MoE methods keep ``tiny-moe``); its vocabulary is the data's — with ``--data`` a folder from
``lattica data prepare``, whose tokens are memory-mapped. The JSON line then also carries
``<name>_bpb``: the validation loss in bits per UTF-8 byte, comparable across tokenizers (for
byte-level data, nats / ln 2), and ``<name>_vs_nocomm`` when ``nocomm`` ran.

Adding a method: register its strategy in ``lattica.train.strategies.STRATEGIES`` and add a
``Method`` to ``METHODS`` (its own model builder and config if it needs them); the JSON line
then carries ``<name>_loss``, ``<name>_bytes`` and ``<name>_vs_ddp``.

    python benchmarks/convergence.py [--data PATH] [--model tiny|llama-tiny|…] [--strategies ddp,nocomm,diloco|all]
        [--seed N]
        [--steps 500] [--batch-size 8] [--context 128] [--lr 3e-3] [--warmup 50]
        [--outer-lr 0.7] [--outer-momentum 0.9] [--warm-start-steps 0] [--workers 4]
        [--device cpu|cuda] [--compile auto|true|false]

``diloco_gossip`` is DiLoCo with gossip averaging (groups of 2 redrawn every round, no
all-reduce); like NoLoCo its replicas differ, so it also reports the loss of their averaged
weights, and ``diloco_gossip_vs_diloco`` compares it with DiLoCo's all-reduce.
``diloco_gossip_overlap`` is the same with each round's exchange overlapped with the next inner
phase (``DiLoCoConfig.overlap``: landed one round late, the phase started from the look-ahead).

``--strategies all`` runs every method: one per strategy registered in
``lattica.train.strategies.STRATEGIES`` (with the ``Method`` of ``METHODS`` if there is one, else
the strategy's default config on the tiny model), plus the extra methods of ``METHODS``
(``moe_diloco``, SPES's baseline). A method that does not finish (an error, a replica
without a finite validation loss) fails the run: exit status 1, one line on stderr, no figures.

Every method gets the same inner hyperparameters (AdamW, warmup + cosine over ``--steps``).
``--outer-lr`` / ``--outer-momentum`` change only the DiLoCo runs (``diloco``, its gossip
variants, ``moe_diloco``), for sweeps; without them DiLoCo runs with its defaults η 0.7, μ 0.9.
A method that trains ``--model`` other than ``tiny`` takes the strategy defaults of that
model's family where they differ (``lattica/train/settings/family_defaults.py``: a Llama preset's
DiLoCo η 0.5, …), as ``lattica join`` does; ``--outer-lr`` and ``--set`` still win.

``--device cuda`` trains the workers on one GPU (CPU stays the default): each worker's inner
steps run in its own thread on its own CUDA stream (the trainer's), so the workers' steps
overlap on the device; the model is compiled there (``--compile``, default auto: on CUDA); DDP
averages its gradients on the device (``DDPConfig.reduce_on_device``: the in-memory collective
sums them where they are) instead of copying them to the host every step. DiLoCo's outer
state stays on the host, pinned, as in the product.

``--measure-memory`` runs each method in a forked child process and reports
``<name>_peak_memory_bytes``: the child's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` right after the fork) minus its resident memory at that moment, divided
by the number of workers — what one worker's model, optimizer and strategy state, activations and
sync buffers added at their peak, measured the same way for every method (Linux only).

The workers themselves (training, averaging, byte and memory accounting) are
``lattica_lab/convergence_workers.py``; this script holds the command line, the methods and the
summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)
import torch
import trio

from lattica.errors import ConfigError
from lattica.train.engine.data import DataConfig, load_corpus
from lattica.train.engine.device import select_device
from lattica.train.engine.model_spec import model_names, resolve_model
from lattica.train.engine.moe import build_moe_model
from lattica.train.engine.tokenized import bits_per_byte
from lattica.train.settings.family_defaults import family_defaults
from lattica.train.strategies import STRATEGIES
from lattica.train.strategies.co2 import CO2Config
from lattica.train.strategies.demo_momentum import DeMoConfig
from lattica.train.strategies.desloc import DESLOCConfig, LocalAdamConfig
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica.train.strategies.eager import EagerDiLoCoConfig
from lattica.train.strategies.noloco import NoLoCoConfig
from lattica.train.strategies.sparseloco import SparseLoCoConfig
from lattica.train.strategies.spes import SPESConfig
from lattica.train.strategies.streaming import StreamingDiLoCoConfig
from lattica.train.strategies.streaming_eager import StreamingEagerConfig
from lattica_lab.convergence_workers import (
    WORKERS,
    BenchmarkFailed,
    Budget,
    Method,
    peers_of,
    run_measured,
    run_timed,
    tiny_model,
    warm_start,
)

PEERS = tuple(f"worker-{i}" for i in range(WORKERS))
# the in-memory collective has no stragglers to cut short: a partner is waited for as long as it takes
_EXCHANGE_WAIT_S = 3600.0
SYNC_EVERY = 50  # H: inner steps between two syncs of DiLoCo and its variants
WARM_START_STEPS = 0  # steps of shared pretraining every method starts from (0: fresh weights)
SCRATCH_METHODS = ("ddp", "diloco")  # also compared from the seed's fresh weights


def _tiny_moe(seed: int) -> torch.nn.Module:
    return build_moe_model("tiny-moe", seed=seed)


METHODS: dict[str, Method] = {
    "ddp": Method(strategy="ddp"),
    "nocomm": Method(strategy="nocomm"),
    "diloco": Method(strategy="diloco", config=DiLoCoConfig(inner_steps=SYNC_EVERY)),
    "noloco": Method(
        strategy="noloco", config=NoLoCoConfig(inner_steps=SYNC_EVERY, exchange_timeout_s=_EXCHANGE_WAIT_S),
        evaluate_average=True,
    ),
    "diloco_gossip": Method(
        strategy="diloco",
        config=DiLoCoConfig(
            inner_steps=SYNC_EVERY, averaging="gossip", group_size=2, exchange_timeout_s=_EXCHANGE_WAIT_S
        ),
        evaluate_average=True,
    ),
    # the same with each round's exchange overlapped with the next inner phase (landed one round late)
    "diloco_gossip_overlap": Method(
        strategy="diloco",
        config=DiLoCoConfig(
            inner_steps=SYNC_EVERY, averaging="gossip", group_size=2, exchange_timeout_s=_EXCHANGE_WAIT_S,
            overlap=True,
        ),
        evaluate_average=True,
    ),
    # eager and Streaming-eager at their defaults (eager η 0.5, Streaming-eager η 0.7; μ 0.9)
    "eager": Method(strategy="eager", config=EagerDiLoCoConfig(inner_steps=SYNC_EVERY)),
    "streaming": Method(
        strategy="streaming",
        config=StreamingDiLoCoConfig(
            inner_steps=SYNC_EVERY, fragments=2, overlap_steps=2, mixing=0.5
        ),
    ),
    "streaming_eager": Method(
        strategy="streaming_eager",
        config=StreamingEagerConfig(inner_steps=SYNC_EVERY, fragments=2),
    ),
    # SparseLoCo at its defaults but H = 25: 20 sparse rounds cost less than a fiftieth of
    # DiLoCo's 10 dense ones, and with only 10 rounds too little of the model ever moves
    "sparseloco": Method(strategy="sparseloco", config=SparseLoCoConfig(inner_steps=SYNC_EVERY // 2)),
    "demo": Method(strategy="demo", config=DeMoConfig(inner_steps=SYNC_EVERY)),  # syncs every step
    # Local Adam averages x, u and v every H; DES-LOC x every H, u every 3H, v every 6H
    "local_adam": Method(strategy="local_adam", config=LocalAdamConfig(inner_steps=SYNC_EVERY)),
    "desloc": Method(strategy="desloc", config=DESLOCConfig(inner_steps=SYNC_EVERY)),
    "co2": Method(strategy="co2", config=CO2Config(inner_steps=SYNC_EVERY)),
    "moe_diloco": Method(
        strategy="diloco", config=DiLoCoConfig(inner_steps=SYNC_EVERY), build_model=_tiny_moe
    ),
    "spes": Method(
        strategy="spes",
        config=SPESConfig(
            sync_every=SYNC_EVERY, merge_every=100, merge_decay_steps=1000, members=PEERS
        ),
        build_model=_tiny_moe,
    ),
}


def all_methods(workers: int = WORKERS) -> dict[str, Method]:
    """Every registered strategy (``METHODS``' entry, else its defaults), then ``METHODS``' extras
    (SPES's initial expert owners: the ``workers`` peers)."""
    methods = {name: METHODS.get(name, Method(strategy=name)) for name in STRATEGIES}
    methods |= {name: m for name, m in METHODS.items() if name not in methods}
    spes = methods["spes"]
    methods["spes"] = dataclasses.replace(spes, config=dataclasses.replace(spes.config, members=peers_of(workers)))
    return methods


def with_model(methods: dict[str, Method], model: str, vocab_size: int, context: int) -> dict[str, Method]:
    """``methods`` training the preset ``model`` (sized for the data) where they train ``tiny``,
    with the strategy defaults of the model's family where they differ (``family_defaults``, as
    ``lattica join`` resolves them)."""
    if model == "tiny":
        return methods
    spec = resolve_model(model, vocab_size=vocab_size, seq_len=context)
    if spec.context < context:
        raise ConfigError(f"model {model} has a context of {spec.context}, shorter than --context {context}")

    def build(seed: int) -> torch.nn.Module:
        return spec.build(seed=seed)

    def retarget(m: Method) -> Method:
        defaults = family_defaults(m.strategy, spec.family)
        config = dataclasses.replace(m.config, **defaults) if defaults and m.config is not None else m.config
        return dataclasses.replace(m, build_model=build, config=config)

    return {name: retarget(m) if m.build_model is tiny_model else m for name, m in methods.items()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="stdlib", help="text file/folder/JSONL/.bin (default: stdlib)"
    )
    parser.add_argument(
        "--strategies",
        default="ddp,nocomm,diloco",
        help=f"comma-separated, from {sorted(all_methods())}, or 'all'",
    )
    parser.add_argument("--model", default="tiny", choices=model_names(),
                        help="built-in preset (default tiny; llama-* take the data's vocabulary)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Budget.steps, help="inner steps per worker")
    parser.add_argument("--batch-size", type=int, default=Budget.batch_size)
    parser.add_argument("--lr", type=float, default=Budget.lr, help="peak inner learning rate")
    parser.add_argument("--context", type=int, default=Budget.context, help="bytes per sequence")
    parser.add_argument("--warmup", type=int, default=Budget.warmup, help="inner warmup steps")
    parser.add_argument("--eval-batches", type=int, default=Budget.eval_batches)
    parser.add_argument(
        "--outer-lr", type=float, default=None,
        help="DiLoCo's outer lr η, for sweeps (default 0.7; a llama preset's 0.5)"
    )
    parser.add_argument(
        "--outer-momentum", type=float, default=None, help="DiLoCo's outer μ, for sweeps (0.9)"
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=WARM_START_STEPS,
        help="steps of shared single-worker pretraining every method starts from (0: from scratch)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per operation")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"in-process workers (default {WORKERS})")
    parser.add_argument(
        "--set", action="append", default=[], metavar="METHOD.FIELD=VALUE", dest="overrides",
        help="replace one field of a method's strategy config, for sweeps (repeatable), "
        "e.g. --set demo.topk=64 --set sparseloco.error_decay=0.9",
    )
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where the workers train (default cpu)"
    )
    parser.add_argument("--compile", default="auto", choices=("auto", "true", "false"),
                        help="torch.compile the workers' models (default auto: on CUDA)")
    parser.add_argument(
        "--measure-memory", action="store_true",
        help="each method in a forked child: peak resident memory per worker (<name>_peak_memory_bytes)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.workers < 2:
        print("error: --workers must be at least 2", file=sys.stderr)
        return 2
    known = all_methods(args.workers)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if names == ["all"]:
        names = list(known)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"error: unknown strategies {unknown}; known: {sorted(known)}, all", file=sys.stderr)
        return 2
    if args.steps < SYNC_EVERY or args.steps % SYNC_EVERY:
        print(
            f"error: --steps must be a multiple of {SYNC_EVERY} (the sync period)", file=sys.stderr
        )
        return 2
    if args.measure_memory and args.device != "cpu":
        print("error: --measure-memory forks a child per method: CPU only", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        select_device(args.device)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    budget = Budget(
        steps=args.steps,
        batch_size=args.batch_size,
        context=args.context,
        lr=args.lr,
        warmup=args.warmup,
        eval_batches=args.eval_batches,
        device=args.device,
        compile={"true": True, "false": False}.get(args.compile, "auto"),
    )
    try:
        corpus = load_corpus(DataConfig(source=args.data))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = args.workers * budget.steps * budget.batch_size * budget.context
    print(f"data: {corpus.description} (sha256 {corpus.content_hash[:12]}), model {args.model}")
    print(
        f"{args.workers} workers x {budget.steps} steps x {budget.batch_size}x{budget.context} "
        f"tokens = {tokens} tokens per method, seed {args.seed}, on {select_device(args.device).describe()}"
    )
    try:
        methods = with_model(known, args.model, corpus.vocab_size, budget.context)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        methods = with_command_line(methods, args.outer_lr, args.outer_momentum, args.overrides)
    except (ValueError, ConfigError) as exc:
        print(f"error: --set: {exc}", file=sys.stderr)
        return 2
    initial: dict[Callable[[int], torch.nn.Module], dict[str, torch.Tensor]] = {}
    if args.warm_start_steps > 0:
        for build in dict.fromkeys(methods[name].build_model for name in names):
            started = time.monotonic()
            initial[build] = trio.run(
                warm_start, build, corpus, budget, args.seed, args.warm_start_steps
            )
            print(
                f"warm start: {args.warm_start_steps} single-worker steps "
                f"in {time.monotonic() - started:.1f} s"
            )
    results: dict[str, dict[str, float]] = {}
    try:
        for name in names:
            method = methods[name]
            run = run_measured if args.measure_memory else run_timed
            results[name] = run(
                name, method, corpus, budget, args.seed, initial.get(method.build_model), args.workers
            )
        if initial:  # the headline pair again from fresh weights, so both regimes are on record
            for name in (n for n in SCRATCH_METHODS if n in names):
                results[f"scratch_{name}"] = run_timed(
                    f"scratch_{name}", methods[name], corpus, budget, args.seed, None, args.workers
                )
    except BenchmarkFailed as exc:
        print(f"convergence benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(f"{'method':<16}{'val loss':>10}{'spread':>9}{'MB sent/worker':>16}{'seconds':>9}")
    for name, r in results.items():
        memory = f"{r['peak_memory_bytes'] / 1e6:>10.1f} MB peak/worker" if "peak_memory_bytes" in r else ""
        print(
            f"{name:<16}{r['loss']:>10.4f}{r['loss_spread']:>9.4f}"
            f"{r['bytes'] / 1e6:>16.2f}{r['seconds']:>9.1f}{memory}"
        )
    summary = summary_json(results, args.seed, tokens, args.workers)
    summary["warm_start_steps"] = args.warm_start_steps
    summary["model"] = args.model
    summary["device"] = select_device(args.device).describe()
    summary.update(bits_per_byte_json(results, corpus.bytes_per_token))
    print(json.dumps(summary))
    return 0


def with_command_line(
    methods: dict[str, Method], outer_lr: float | None, outer_momentum: float | None, overrides: list[str]
) -> dict[str, Method]:
    """``methods`` (already on their model, with its family's defaults) with what the command
    line sets: ``--outer-lr`` / ``--outer-momentum``, then every ``--set``; these win."""
    return with_overrides(_with_outer(methods, outer_lr, outer_momentum), overrides)


def _with_outer(
    methods: dict[str, Method], lr: float | None, momentum: float | None
) -> dict[str, Method]:
    """``methods`` with DiLoCo's outer lr / momentum replaced where given (both DiLoCo runs)."""
    changes = {k: v for k, v in (("outer_lr", lr), ("outer_momentum", momentum)) if v is not None}
    if not changes:
        return methods
    return {
        name: dataclasses.replace(m, config=dataclasses.replace(m.config, **changes))
        if type(m.config) is DiLoCoConfig
        else m
        for name, m in methods.items()
    }


def with_overrides(methods: dict[str, Method], overrides: list[str]) -> dict[str, Method]:
    """``methods`` with ``METHOD.FIELD=VALUE`` applied to each named method's config (the value
    parsed as the field's current type; the config validates it)."""
    methods = dict(methods)
    for item in overrides:
        target, sep, raw = item.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or name not in methods:
            raise ValueError(f"{item!r}: expected METHOD.FIELD=VALUE with METHOD one of {sorted(methods)}")
        config = methods[name].config
        if config is None:
            raise ValueError(f"{item!r}: {name} runs without a config to change")
        if key not in {f.name for f in dataclasses.fields(config)}:
            raise ValueError(f"{item!r}: {type(config).__name__} has no field {key!r}")
        current = getattr(config, key)
        value: Any = raw.lower() in ("1", "true", "yes") if isinstance(current, bool) else type(current)(raw)
        methods[name] = dataclasses.replace(methods[name], config=dataclasses.replace(config, **{key: value}))
    return methods


def bits_per_byte_json(results: dict[str, dict[str, float]], bytes_per_token: float) -> dict[str, Any]:
    """``<name>_bpb`` for every method, and ``<name>_vs_nocomm`` when ``nocomm`` ran."""
    out: dict[str, Any] = {"bytes_per_token": round(bytes_per_token, 5)}
    for name, r in results.items():
        out[f"{name}_bpb"] = round(bits_per_byte(r["loss"], bytes_per_token), 5)
    nocomm = results.get("nocomm")
    for name, r in results.items():
        if nocomm is not None and name != "nocomm" and not name.startswith("scratch_"):
            out[f"{name}_vs_nocomm"] = round(r["loss"] / nocomm["loss"], 5)
    return out


def summary_json(
    results: dict[str, dict[str, float]], seed: int, tokens: int, workers: int = WORKERS
) -> dict[str, Any]:
    out: dict[str, Any] = {"seed": seed, "tokens_per_method": tokens, "workers": workers}
    for name, r in results.items():
        out[f"{name}_loss"] = round(r["loss"], 5)
        out[f"{name}_bytes"] = int(r["bytes"])
    for name, r in results.items():
        if name.startswith("scratch_"):
            continue
        out[f"{name}_peak_sync_bytes"] = int(r["peak_sync_bytes"])
        out[f"{name}_optimizer_state_bytes"] = int(r["optimizer_state_bytes"])
        if "peak_memory_bytes" in r:
            out[f"{name}_peak_memory_bytes"] = int(r["peak_memory_bytes"])
        if "avg_weights_loss" in r:
            out[f"{name}_avg_weights_loss"] = round(r["avg_weights_loss"], 5)
    for name, baseline in (
        ("noloco", "diloco"),
        ("diloco_gossip", "diloco"),
        ("diloco_gossip_overlap", "diloco"),
        ("diloco_gossip_overlap", "diloco_gossip"),
        ("eager", "diloco"),
        ("streaming", "diloco"),
        ("streaming_eager", "diloco"),
        ("streaming_eager", "streaming"),
        ("spes", "moe_diloco"),
        ("sparseloco", "diloco"),
        ("desloc", "local_adam"),
        ("co2", "diloco"),
    ):
        if name in results and baseline in results:
            out[f"{name}_vs_{baseline}"] = round(
                results[name]["loss"] / results[baseline]["loss"], 5
            )
    if "streaming" in results and "diloco" in results:
        out["streaming_peak_vs_diloco"] = round(
            results["streaming"]["peak_sync_bytes"] / results["diloco"]["peak_sync_bytes"], 5
        )
    if "sparseloco" in results and "diloco" in results and results["sparseloco"]["bytes"]:
        out["diloco_bytes_vs_sparseloco"] = round(
            results["diloco"]["bytes"] / results["sparseloco"]["bytes"], 2
        )
    if "desloc" in results and "local_adam" in results and results["desloc"]["bytes"]:
        out["local_adam_bytes_vs_desloc"] = round(results["local_adam"]["bytes"] / results["desloc"]["bytes"], 3)
    if "spes" in results and "moe_diloco" in results:
        out["spes_optimizer_state_vs_moe_diloco"] = round(
            results["spes"]["optimizer_state_bytes"]
            / results["moe_diloco"]["optimizer_state_bytes"],
            5,
        )
    if "scratch_ddp" in results and "scratch_diloco" in results:
        out["scratch_diloco_vs_ddp"] = round(
            results["scratch_diloco"]["loss"] / results["scratch_ddp"]["loss"], 5
        )
    ddp = results.get("ddp")
    for name, r in results.items():
        if ddp is not None and name != "ddp" and not name.startswith("scratch_"):
            out[f"{name}_vs_ddp"] = round(r["loss"] / ddp["loss"], 5)
            if r["bytes"]:
                out[f"ddp_bytes_vs_{name}"] = round(ddp["bytes"] / r["bytes"], 2)
    return out


if __name__ == "__main__":
    sys.exit(main())
