"""What the auto-tuner's choice is worth on a WAN: utilization and loss, tuned vs DiLoCo's default.

Four peer processes in the WAN lab (``lattica_lab.wan``: two sites of two hosts, joined by a
delay line of 100 ms RTT and the given rate each way) train the tiny byte-level GPT on the
Python standard library corpus with the real trainer and the real data plane (``TensorService``
over libp2p), each on its own shard, all from the same weights. For each link rate
(``--rates``, default 20 and 200 Mbit/s) three phases run back to back, the same steps each:

- ``nocomm``: no communication — the reference wall time;
- ``default``: DiLoCo as a user gets it untuned (H 50, fp32, blocking all-reduce);
- ``tuned``: the configuration ``train/settings/autotune.py`` chooses as ``tune = true`` would,
  from what this run measured: the inner step (the first ``nocomm`` and ``default`` phases': a
  blocking phase's steps run with no exchange in flight too), the model's payload, the link (its
  configured rate and RTT; ``benchmarks/wan_lab.py`` measures the delay line within a few
  percent of them) and the communication CPU per byte and per round — first the blocking ``default``
  phase's process CPU in its syncs; when that choice overlaps (strategy ``eager`` or ``co2``), one
  phase of it is run and its inner steps' slow-down — the steps an exchange ran beside against the same
  phase's steps before its first sync, as ``tune = true`` times them, so a change in the
  machine's load between phases is not taken for the exchange's cost — is fed back, with that
  clean step, for a second tuning, whose choice the cycles run (H, the codec and overlap; the
  group stays the whole round: these peers average by all-reduce, a gossip group would need the
  daemon's group coordination).

The phase's length (``--steps``, default 2,000) is the run the tuner plans for (its steps left):
it keeps no H that leaves fewer than ``tune_min_rounds`` (8) applied outer rounds. On these
cores an overlapped round slows the steps beside it by 0.15–0.25 s whatever its payload, so the
target needs an inner phase of 3–5 s — H 100–200 at a 25–40 ms step — and H 200 overlapped
leaves 8 applied rounds only from 9 × 200 = 1,800 steps: 2,000 is the next multiple of 400. A
400-step phase allows H ≤ 25 overlapped (≤ 50 blocking), whose best predicted utilization is
0.5–0.8: a run that short cannot meet both targets, and a user's run is longer.

``<x>_util_vs_nocomm`` is the ``nocomm`` wall over the phase's wall (the wall from the first
inner step to the return of the last one's ``after_inner_step``; overlap.py's measure), taken
within each cycle (``--cycles``, default 3: the three phases in turn, so load that drifts hits
them alike) and reported as the median over the cycles, every cycle's ratio beside it;
``tuned_loss_vs_diloco`` is the tuned phase's validation loss (mean over the peers) over the
default's. Targets: tuned utilization ≥ 0.95 and loss ≤ 1.03 × DiLoCo's at both rates. Beside
them: each phase's mean inner step per cycle (``step_ms``), each tuning's choice and the CPU per
byte and per round it was given (``tunings``), and the CPU per round the tuned phases then
measured (``tuned_comm_cpu_round_ms``).

A phase that does not finish — a peer that exits or misses its deadline, fewer steps than asked,
a skipped sync — fails the run: exit status 1 and one line on stderr, no figures.

    python benchmarks/autotune.py [--rates 20,200] [--steps 2000] [--rtt-ms 100] [--target 0.95] [--cycles 3]

Needs root, ``ip`` and ``/dev/net/tun`` (the WAN lab); without them it says so and exits with
status 2. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)
import overlap

WORKERS = 4
DEFAULT_H = 50
PHASE_TIMEOUT_S = 1800.0
CLEAN_SKIP_STEPS = 2  # a phase's first steps, left out of its clean step (warm-up)
BATCH, CONTEXT, LR = 8, 128, 1e-3


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


# ---------------------------------------------------------------------------- one peer process


def _config(cmd: dict):
    from lattica.train.strategies.co2 import CO2Config
    from lattica.train.strategies.diloco import DiLoCoConfig
    from lattica.train.strategies.eager import EagerDiLoCoConfig

    if cmd["strategy"] == "nocomm":
        return None
    config_class = {"co2": CO2Config, "eager": EagerDiLoCoConfig}.get(cmd["strategy"], DiLoCoConfig)
    return config_class(inner_steps=cmd["inner_steps"], codec=cmd["codec"])


async def _train(service, corpus, cmd: dict) -> dict:
    """Train one phase to completion; inner-step time, wall time and the validation loss."""
    from lattica.train.engine.data import BatchConfig, BatchSampler, validation_batches
    from lattica.train.engine.device import select_device
    from lattica.train.engine.model import build_model
    from lattica.train.engine.schedule import ScheduleConfig
    from lattica.train.engine.task import Task
    from lattica.train.engine.trainer import Trainer, TrainerConfig
    from lattica.train.strategies import create_strategy
    from lattica.train.strategies.co2 import FIRST_IN_FLIGHT

    steps = cmd["steps"]
    model = build_model("tiny", seed=0)
    collective = overlap._TimedCollective(service)
    strategy = create_strategy(
        cmd["strategy"], model, collective=collective, groups=overlap._FixedGroups(cmd["peers"]), config=_config(cmd),
    )
    sampler = BatchSampler(corpus.train, BatchConfig(batch_size=BATCH, context=CONTEXT, seed=0,
                                                     shard_index=cmd["index"], num_shards=len(cmd["peers"])))
    val = validation_batches(corpus.val, batch_size=BATCH, context=CONTEXT, max_batches=16)
    task = Task(model=model, train_batches=iter(sampler), val_batches=val, sampler=sampler)
    config = TrainerConfig(total_steps=steps, eval_every=0, log_every=steps,
                           schedule=ScheduleConfig(lr=LR, warmup_steps=20, total_steps=steps))
    rounds = {"done": 0, "skipped": 0}

    def count_round(event) -> None:
        if event.report.detail == FIRST_IN_FLIGHT:  # CO2's first sync: its mean lands at the next
            return
        rounds["skipped" if event.report.skipped else "done"] += 1

    trainer = Trainer(task, strategy, config, device=select_device("cpu"), on_round=count_round)
    timing = {"inner": 0.0, "inner_cpu": 0.0, "sync_cpu": 0.0, "first": None, "last": None,
              "done": 0, "first_phase": 0.0, "clean": 0.0}
    whole_step, after_inner_step = trainer._whole_step, strategy.after_inner_step
    first_sync = 0 if cmd["strategy"] == "nocomm" else cmd["inner_steps"]

    def timed_step() -> float:
        started, cpu_started = time.perf_counter(), time.thread_time()
        timing["first"] = timing["first"] or started
        try:
            return whole_step()
        finally:
            elapsed = time.perf_counter() - started
            timing["inner"] += elapsed
            timing["inner_cpu"] += time.thread_time() - cpu_started
            timing["done"] += 1
            if timing["done"] <= first_sync:  # before the first sync: no exchange in flight
                timing["first_phase"] += elapsed
                if timing["done"] > CLEAN_SKIP_STEPS:
                    timing["clean"] += elapsed

    async def timed_after(step: int):
        cpu_started = time.process_time()  # the worker thread is idle: a blocking sync's CPU
        reports = await after_inner_step(step)
        timing["sync_cpu"] += time.process_time() - cpu_started
        if step == steps:
            timing["last"] = time.perf_counter()
        return reports

    trainer._whole_step = timed_step
    strategy.after_inner_step = timed_after
    cpu_before = time.process_time()
    summary = await trainer.run()
    process_cpu = time.process_time() - cpu_before
    if timing["first"] is None or timing["last"] is None or summary.steps != steps:
        return {"ok": False, "error": f"trained {summary.steps} of {steps} steps"}
    return {
        "ok": True, "steps": summary.steps, "syncs": rounds["done"], "skipped_syncs": rounds["skipped"],
        "wall_s": timing["last"] - timing["first"], "step_s": timing["inner"] / steps,
        "step_cpu_s": timing["inner_cpu"] / steps, "other_cpu_s": process_cpu - timing["inner_cpu"],
        **_phase_steps(timing, steps, first_sync),
        "sync_cpu_s": timing["sync_cpu"], "bytes_sent": summary.bytes_sent,
        "val_loss": summary.val_loss, "model_bytes": 4 * sum(p.numel() for p in model.parameters()),
    }


def _phase_steps(timing: dict, steps: int, first_sync: int) -> dict:
    """The mean step before the first sync (``clean_step_s``: no exchange in flight, its first
    ``CLEAN_SKIP_STEPS`` left out, as ``tune = true``'s ``PhaseTimer`` starts two steps in) and
    after it (``later_step_s``: an overlapped phase's exchanges run beside these)."""
    if not 0 < first_sync < steps or first_sync <= CLEAN_SKIP_STEPS:
        return {}
    return {"clean_step_s": timing["clean"] / (first_sync - CLEAN_SKIP_STEPS),
            "later_step_s": (timing["inner"] - timing["first_phase"]) / (steps - first_sync)}


async def _serve(ip: str) -> None:
    import multiaddr
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from lattica.net.host import build_host
    from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
    from lattica.train.engine.data import DataConfig, load_corpus

    torch.set_num_threads(1)
    corpus = load_corpus(DataConfig(source="stdlib"))
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    service = TensorService(host, key_pair, config=TensorServiceConfig())
    async with host.run([multiaddr.Multiaddr(f"/ip4/{ip}/tcp/0")]), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        overlap._reply({"peer_id": service.peer_id, "addr": str(host.get_addrs()[0])})
        async for line in trio.wrap_file(sys.stdin):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "connect":
                for addr in cmd["addrs"]:
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                overlap._reply({"ok": True, "op": "connect"})
            elif cmd["op"] == "train":
                overlap._reply({"op": "train", **await _train(service, corpus, cmd)})
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------- the coordinator


def _phase(procs, peers: list[str], name: str, phase: dict, steps: int) -> list[dict]:
    for i, proc in enumerate(procs):
        proc.send({"op": "train", "peers": peers, "index": i, "steps": steps, **phase})
    try:
        rows = [p.wait_for(lambda e: e.get("op") == "train", timeout=PHASE_TIMEOUT_S, fresh=True) for p in procs]
    except (TimeoutError, RuntimeError) as exc:
        raise BenchmarkFailed(f"{name} phase did not finish: {exc}") from None
    check_phase(name, rows, steps, phase)
    print(f"{name:<16} wall {statistics.fmean(r['wall_s'] for r in rows):.1f}s  "
          f"step {1000 * statistics.fmean(r['step_s'] for r in rows):.1f} ms "
          f"(CPU {1000 * statistics.fmean(r['step_cpu_s'] for r in rows):.1f} ms)  "
          f"other CPU {statistics.fmean(r['other_cpu_s'] for r in rows):.2f}s "
          f"(in syncs {statistics.fmean(r['sync_cpu_s'] for r in rows):.2f}s)  "
          f"sent {statistics.fmean(r['bytes_sent'] for r in rows) / 1e6:.1f} MB  "
          f"val loss {statistics.fmean(r['val_loss'] for r in rows):.4f}", flush=True)
    return rows


def check_phase(name: str, rows: list[dict], steps: int, phase: dict) -> None:
    """Raise ``BenchmarkFailed`` unless every peer trained every step, completed its syncs (CO2:
    all but the last, whose mean lands after training) and measured a finite loss."""
    syncs = 0 if phase["strategy"] == "nocomm" else steps // phase["inner_steps"] - _overlapped(phase)
    if len(rows) != WORKERS:
        raise BenchmarkFailed(f"{name}: {len(rows)} peer reports, not {WORKERS}")
    for i, row in enumerate(rows):
        if not row.get("ok") or row.get("steps") != steps:
            raise BenchmarkFailed(f"{name}: peer {i} did not finish: {row.get('error', row)}")
        if row.get("skipped_syncs") or row.get("syncs", 0) < syncs:
            raise BenchmarkFailed(f"{name}: peer {i} completed {row.get('syncs')} of {syncs} syncs "
                                  f"({row.get('skipped_syncs')} skipped)")
        loss = row.get("val_loss")
        if not isinstance(loss, float) or not math.isfinite(loss) or not row.get("wall_s", 0) > 0:
            raise BenchmarkFailed(f"{name}: peer {i} reported no finite loss or no wall time")


def _tuned(step_s: float, model_bytes: int, rate_mbit: float, args: argparse.Namespace, cpu: tuple[float, float],
           why: str):
    """The tuner's choice for the measured step (with no exchange in flight), payload, link,
    communication CPU per byte and per round, and the phase's steps (the rounds an H leaves
    them); every search step printed."""
    from lattica.train.settings.autotune import Measurements, tune

    measured = Measurements(
        step_s=step_s, model_bytes=model_bytes,
        bandwidth_bps=rate_mbit * 1e6, rtt_s=args.rtt_ms / 1000, peers=WORKERS, comm_cpu_s_per_byte=cpu[0],
        comm_cpu_s_per_round=cpu[1], shared_cores=True, steps_left=args.steps,
    )
    tuned = tune(measured, target=args.target, fixed={"group_size": 0}, min_rounds=args.min_rounds,
                 max_loss=args.max_loss / 100)
    print(f"  tuning ({why}): step {1000 * measured.step_s:.1f} ms, communication CPU {cpu[0] * 1e9:.0f} ns/byte, "
          f"at least {1000 * cpu[1]:.0f} ms a round", flush=True)
    for choice in tuned.choices:
        print(f"    {choice.line()}", flush=True)
    return measured, tuned


def _phase_of(config) -> dict:
    """The phase of a tuned all-reduce configuration: its overlap method's strategy (``eager`` or
    ``co2``), else ``diloco``."""
    return {"strategy": config.overlap or "diloco", "inner_steps": config.inner_steps, "codec": config.codec}


def _overlapped(phase: dict) -> bool:
    """A phase whose round's mean lands a round late, its exchange beside the next steps."""
    return phase["strategy"] in ("co2", "eager")


def _comm_cpu(rows: list[dict], phase: dict) -> tuple[float, float]:
    """CPU per byte sent and per round, as ``tune = true`` measures them
    (``train/settings/retune.py``): a blocking phase's process CPU in its syncs, over its bytes
    and its rounds; an overlapped phase's slow-down — each peer's steps with an exchange beside
    them against its own steps before the first sync, the same phase at the same load (a
    reference phase run minutes earlier would count the change in the machine's load as the
    exchange's cost) — over the bytes and the rounds of the exchanges that ran beside steps (CO2's
    landed ones: all but the last, which lands after training). The mean over the peers."""
    from lattica.train.settings.autotune import comm_cpu_per_byte, slowdown_cpu_per_byte

    per_byte, per_round = [], []
    for r in rows:
        if _overlapped(phase) and "later_step_s" in r:  # else one exchange, beside no step
            exchanges = r["steps"] // phase["inner_steps"]
            rounds = exchanges - 1
            sent = r["bytes_sent"] * rounds / exchanges
            cost = slowdown_cpu_per_byte(step_s=r["later_step_s"], clean_step_s=r["clean_step_s"],
                                         steps=r["steps"] - phase["inner_steps"], bytes_sent=sent)
        elif _overlapped(phase):
            rounds, sent, cost = 0, 0.0, 0.0
        else:
            rounds, sent = r["syncs"], r["bytes_sent"]
            cost = comm_cpu_per_byte(cpu_s=r["sync_cpu_s"], bytes_sent=sent)
        per_byte.append(cost)
        per_round.append(cost * sent / max(rounds, 1))
    return statistics.fmean(per_byte), statistics.fmean(per_round)


def _run_rate(lab, procs, peers, args, rate: float) -> dict:
    """The three phases at ``rate``, ``--cycles`` times in turn. The tuner chooses as ``tune =
    true`` would: from the first ``nocomm`` phase's step and the first ``default`` (blocking)
    phase's communication CPU; when that choice overlaps, one phase of it measures the
    inner steps' slow-down, which is fed back for a second tuning, whose choice the cycles run.
    Each utilization is the median over the cycles of that cycle's ``nocomm`` wall over the
    phase's (load drifts between cycles and hits a cycle's phases alike; overlap.py's ratio)."""
    if lab.links:
        lab.unlink("a", "b")
    lab.link("a", "b", rtt_ms=args.rtt_ms, mbit=rate)
    default = {"strategy": "diloco", "inner_steps": DEFAULT_H, "codec": "fp32"}
    nocomm = {"strategy": "nocomm", "inner_steps": 1, "codec": "fp32"}
    rows: dict[str, list[list[dict]]] = {"nocomm": [], "default": [], "tuned": []}
    first = _phase(procs, peers, f"{rate:g} nocomm 1", nocomm, args.steps)
    first_default = _phase(procs, peers, f"{rate:g} default 1", default, args.steps)
    model_bytes = first[0]["model_bytes"]
    step_s = statistics.fmean(r["step_s"] for r in first + first_default)  # no exchange in flight
    cpu = _comm_cpu(first_default, default)
    measured, tuned = _tuned(step_s, model_bytes, rate, args, cpu, "the blocking default's sync CPU")
    tunings = [{"phase": _phase_of(tuned.config), "comm_cpu_ns": round(cpu[0] * 1e9, 1),
                "comm_cpu_round_ms": round(cpu[1] * 1000, 1)}]
    if tuned.config.overlap:
        probe_phase = _phase_of(tuned.config)
        probe = _phase(procs, peers, f"{rate:g} first tuning", probe_phase, args.steps)
        cpu = _comm_cpu(probe, probe_phase)
        step_s = statistics.fmean(r["clean_step_s"] for r in probe)  # its steps before the first sync
        measured, tuned = _tuned(step_s, model_bytes, rate, args, cpu, "its overlapped phase's slow-down")
        tunings.append({"phase": _phase_of(tuned.config), "comm_cpu_ns": round(cpu[0] * 1e9, 1),
                        "comm_cpu_round_ms": round(cpu[1] * 1000, 1)})
    tuned_phase = _phase_of(tuned.config)
    for cycle in range(args.cycles):
        rows["nocomm"].append(first if cycle == 0 else _phase(procs, peers, f"{rate:g} nocomm {cycle + 1}", nocomm,
                                                              args.steps))
        rows["default"].append(first_default if cycle == 0 else _phase(
            procs, peers, f"{rate:g} default {cycle + 1}", default, args.steps))
        rows["tuned"].append(_phase(procs, peers, f"{rate:g} tuned {cycle + 1}", tuned_phase, args.steps))

    def wall(phase_rows: list[dict]) -> float:
        return statistics.fmean(r["wall_s"] for r in phase_rows)

    def util(name: str) -> list[float]:
        return [round(wall(ref) / wall(x), 4) for ref, x in zip(rows["nocomm"], rows[name], strict=True)]

    def loss(name: str) -> float:
        return statistics.fmean(r["val_loss"] for cycle in rows[name] for r in cycle)

    def step_ms(name: str) -> list[float]:
        return [round(1000 * statistics.fmean(r["step_s"] for r in cycle), 1) for cycle in rows[name]]

    utils = {name: util(name) for name in ("default", "tuned")}
    print(f"{rate:g} Mbit/s per cycle: default util {utils['default']}, tuned util {utils['tuned']}", flush=True)
    return {
        "tuned_util_vs_nocomm": statistics.median(utils["tuned"]),
        "default_util_vs_nocomm": statistics.median(utils["default"]),
        "tuned_loss_vs_diloco": round(loss("tuned") / loss("default"), 4),
        "config": {**tuned_phase, "chunk_bytes": tuned.config.chunk_bytes,
                   "predicted_util": round(tuned.prediction.utilization, 4),
                   "predicted_loss_cost": round(tuned.prediction.loss_cost, 4), "meets_target": tuned.meets_target,
                   "within_loss_budget": tuned.within_loss_budget,
                   "shortfall": tuned.shortfall,
                   "step_ms": round(1000 * measured.step_s, 1), "model_bytes": measured.model_bytes,
                   "comm_cpu_ns_per_byte": round(measured.comm_cpu_s_per_byte * 1e9, 1),
                   "comm_cpu_ms_per_round": round(measured.comm_cpu_s_per_round * 1000, 1)},
        "tunings": tunings,
        "tuned_comm_cpu_round_ms": [round(_comm_cpu(x, tuned_phase)[1] * 1000, 1) for x in rows["tuned"]],
        "loss": {name: round(loss(name), 4) for name in rows},
        "cycles": utils,
        "step_ms": {name: step_ms(name) for name in rows},
    }


def _run_lab(args: argparse.Namespace) -> dict[str, dict]:
    from lattica_lab.wan import WanLab

    results: dict[str, dict] = {}
    with WanLab() as lab:
        sites = [lab.add_site("a", hosts=2), lab.add_site("b", hosts=2)]
        hosts = [h for site in sites for h in site.hosts]
        lab.link("a", "b", rtt_ms=args.rtt_ms, mbit=args.rates[0])
        procs = [lab.spawn(h, [sys.executable, __file__, "--peer", "--ip", h.ip],
                           stderr_path=f"{args.log_dir}/autotune-{h.name}.log" if args.log_dir else None)
                 for h in hosts]
        try:
            hellos = [p.wait_for(lambda e: "peer_id" in e, timeout=300) for p in procs]
            for i, proc in enumerate(procs):
                proc.send({"op": "connect", "addrs": [h["addr"] for h in hellos[i + 1:]]})
                proc.wait_for(lambda e: e.get("op") == "connect", timeout=60, fresh=True)
        except (TimeoutError, RuntimeError) as exc:
            raise BenchmarkFailed(f"the peers did not start and connect: {exc}") from None
        peers = [h["peer_id"] for h in hellos]
        for rate in args.rates:
            results[f"{rate:g}mbit"] = _run_rate(lab, procs, peers, args, rate)
        for proc in procs:
            proc.send({"op": "quit"})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ip", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="20,200", help="link rates to run, Mbit/s each way")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=2000,
                        help="inner steps per phase, a multiple of 400 (long enough for H 200 to leave 8 rounds)")
    parser.add_argument("--target", type=float, default=0.95, help="the tuner's utilization target")
    parser.add_argument("--min-rounds", type=int, default=8,
                        help="applied outer rounds an H must leave a phase to be a candidate (the tuner's default)")
    parser.add_argument("--max-loss", type=float, default=3.0,
                        help="the tuner's loss budget, percent of expected loss increase (its default)")
    parser.add_argument("--cycles", type=int, default=3, help="run the three phases in turn this many times")
    parser.add_argument("--log-dir", default="", help="write each peer's stderr here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.peer:
        import trio

        trio.run(_serve, args.ip)
        return 0
    from lattica_lab.wan import wan_unavailable_reason

    reason = wan_unavailable_reason()
    if reason:
        print(f"error: the WAN lab is unavailable here: {reason}", file=sys.stderr)
        return 2
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.steps % 400:
        print("error: --steps must be a multiple of 400 (every H the tuner may choose divides it)", file=sys.stderr)
        return 2
    try:
        results = _run_lab(args)
    except BenchmarkFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = {
        "link": f"WAN lab: 2 sites x 2 hosts, {args.rtt_ms:g} ms RTT", "workers": WORKERS, "steps": args.steps,
        "cycles_run": args.cycles,
        "default": f"diloco H {DEFAULT_H} fp32 blocking",
        **{key: {rate: r[key] for rate, r in results.items()}
           for key in ("tuned_util_vs_nocomm", "tuned_loss_vs_diloco", "default_util_vs_nocomm")},
        "configs": {rate: r["config"] for rate, r in results.items()},
        "losses": {rate: r["loss"] for rate, r in results.items()},
        "cycles": {rate: r["cycles"] for rate, r in results.items()},
        "step_ms": {rate: r["step_ms"] for rate, r in results.items()},
        "tunings": {rate: r["tunings"] for rate, r in results.items()},
        "tuned_comm_cpu_round_ms": {rate: r["tuned_comm_cpu_round_ms"] for rate, r in results.items()},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
