"""Compute utilization of blocking DiLoCo vs eager, Streaming DiLoCo and CO2 behind a slow link.

Four peer processes, each in its own network namespace of the NAT lab
(``lattica_lab.netlab``) with a tbf qdisc capping its egress, train the tiny byte-level GPT
with the real trainer and the real data plane (``TensorService`` over libp2p). Utilization is
the time spent inside inner steps (forward, backward, optimizer) divided by the wall time from
the first inner step to the return of the last one's ``after_inner_step`` — the steady state;
the drain of the final in-flight sync at the end of training is excluded. Data are random bytes:
utilization does not depend on what is learned.

The defaults put the run in the regime the overlapping strategies are designed for: a sync's
communication fits in the inner steps it may overlap (H steps for eager DiLoCo, τ steps for a
Streaming fragment). The output shows whether it did: ``<strategy>_comm_s`` is the mean wall
time of one collective call (it includes waiting for the slowest peer to reach the sync) and
``<strategy>_window_s`` the mean inner-step time times the steps it may overlap. With a cap so
low that communication outlasts the window, eager and streaming block too, by design.
``<strategy>_step_ms`` is the mean inner step: overlapped communication competes with the inner
steps for the cores (and the GIL), which makes them slower without counting as waiting.

So ``<strategy>_util`` (own inner-step time over own wall) flatters a strategy whose steps got
slower. What a user feels is measured against a no-communication run (``nocomm``, always run
first, same steps, same peers, same run): ``<strategy>_util_vs_nocomm`` is the no-communication
run's wall time over the strategy's (1.0: communication cost nothing at all), and
``<strategy>_speedup_vs_blocking`` is blocking DiLoCo's wall time over the strategy's.

Load from other processes inflates wall times, and it drifts: phases a minute apart ran at
different speeds, the no-communication reference included. So the phases take turns (``--cycles
N`` runs the whole sequence N times) and each ratio is taken within one cycle — the reference's
wall over the strategy's, measured back to back — and reported as the median over the cycles;
the table prints every cycle's ratios. ``<strategy>_wall_s`` is its best cycle's (load only ever
lengthens a phase) and the other figures are means over the cycles. Three diagnostics that load
hardly changes come with each strategy: ``<strategy>_step_cpu_ms`` (the training thread's CPU
per inner step), ``<strategy>_other_cpu_s`` (the rest of a peer's CPU over the run:
communication, codecs, outer steps) and ``<strategy>_step_waits`` (times per inner step the
training thread blocked — waiting for the GIL while the event loop ran communication).

A phase that does not finish — a peer that exits or misses its deadline, fewer steps than
asked, a sync that was skipped or never completed — fails the run: exit status 1 and one line on
stderr naming it, no figures.

    python benchmarks/overlap.py [--rate-mbit 20] [--steps 240] [--inner-steps 40] [--overlap-steps 5]
        [--strategies nocomm,diloco,eager,streaming (or co2)] [--cycles 1]

Needs root, ``ip`` and ``nft`` (the lab); without them it says so and exits with status 2.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

WORKERS = 4
STRATEGIES = ("nocomm", "diloco", "eager", "streaming", "co2")
FRAGMENTS = 2
PHASE_TIMEOUT_S = 1800.0


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


def _strategy_config(name: str, inner_steps: int, overlap_steps: int):
    from lattica.train.strategies.co2 import CO2Config
    from lattica.train.strategies.diloco import DiLoCoConfig
    from lattica.train.strategies.eager import EagerDiLoCoConfig
    from lattica.train.strategies.streaming import StreamingDiLoCoConfig

    if name == "nocomm":
        return None
    if name == "co2":
        return CO2Config(inner_steps=inner_steps)
    if name == "diloco":
        return DiLoCoConfig(inner_steps=inner_steps)
    if name == "eager":
        return EagerDiLoCoConfig(inner_steps=inner_steps)
    return StreamingDiLoCoConfig(
        inner_steps=inner_steps, fragments=FRAGMENTS, overlap_steps=overlap_steps, mixing=0.5
    )


# ---------------------------------------------------------------------------- one peer process


class _FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


def _random_batches(seed: int, batch_size: int, context: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        data = torch.randint(0, 256, (batch_size, context + 1), generator=generator)
        yield data[:, :-1], data[:, 1:]


class _TimedCollective:
    """The data plane as the strategy's ``Collective``, timing every call."""

    def __init__(self, service) -> None:
        self.service = service
        self.peer_id = service.peer_id
        self.seconds: list[float] = []

    async def allreduce(self, tensors, **kwargs):
        started = time.perf_counter()
        try:
            return await self.service.allreduce(tensors, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)

    async def exchange(self, tensors, **kwargs):
        started = time.perf_counter()
        try:
            return await self.service.exchange(tensors, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)


async def _train(service, cmd: dict) -> dict:
    """Train one strategy to completion; report inner-step time, wall time and bytes sent."""
    from lattica.train.engine.device import select_device
    from lattica.train.engine.model import build_model
    from lattica.train.engine.schedule import ScheduleConfig
    from lattica.train.engine.task import Task
    from lattica.train.engine.trainer import Trainer, TrainerConfig
    from lattica.train.strategies import create_strategy
    from lattica.train.strategies.co2 import FIRST_IN_FLIGHT

    steps = cmd["steps"]
    model = build_model("tiny", seed=0)
    collective = _TimedCollective(service)
    strategy = create_strategy(
        cmd["strategy"],
        model,
        collective=collective,
        groups=_FixedGroups(cmd["peers"]),
        config=_strategy_config(cmd["strategy"], cmd["inner_steps"], cmd["overlap_steps"]),
    )
    task = Task(model=model, train_batches=_random_batches(cmd["seed"], 8, 128))
    config = TrainerConfig(
        total_steps=steps,
        eval_every=0,
        log_every=steps,
        schedule=ScheduleConfig(lr=1e-3, warmup_steps=1, total_steps=steps),
    )
    rounds = {"done": 0, "skipped": 0}

    def count_round(event) -> None:
        if event.report.detail == FIRST_IN_FLIGHT:  # CO2's first sync: its mean lands at the next
            return
        rounds["skipped" if event.report.skipped else "done"] += 1

    trainer = Trainer(task, strategy, config, device=select_device("cpu"), on_round=count_round)
    timing = {"inner": 0.0, "inner_cpu": 0.0, "waits": 0, "first": None, "last": None}
    whole_step, after_inner_step = trainer._whole_step, strategy.after_inner_step

    def timed_step() -> float:
        started, cpu_started = time.perf_counter(), time.thread_time()
        waits_before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        timing["first"] = timing["first"] or started
        try:
            return whole_step()
        finally:
            timing["inner"] += time.perf_counter() - started
            timing["inner_cpu"] += time.thread_time() - cpu_started
            timing["waits"] += resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - waits_before

    async def timed_after(step: int):
        reports = await after_inner_step(step)
        if step == steps:
            timing["last"] = time.perf_counter()
        return reports

    trainer._whole_step = timed_step
    strategy.after_inner_step = timed_after
    sent_before = service.stats.total_sent()
    cpu_before = time.process_time()
    summary = await trainer.run()
    process_cpu = time.process_time() - cpu_before
    if timing["first"] is None or timing["last"] is None or summary.steps != steps:
        return {"ok": False, "error": f"trained {summary.steps} of {steps} steps"}
    wall = timing["last"] - timing["first"]
    return {
        "ok": True,
        "steps": summary.steps,
        "syncs": rounds["done"],
        "skipped_syncs": rounds["skipped"],
        "inner_s": timing["inner"],
        "wall_s": wall,
        "util": timing["inner"] / wall,
        "bytes_sent": service.stats.total_sent() - sent_before,
        "step_s": timing["inner"] / steps,
        "step_cpu_s": timing["inner_cpu"] / steps,
        "step_waits": timing["waits"] / steps,
        "other_cpu_s": process_cpu - timing["inner_cpu"],
        "comm_s": statistics.fmean(collective.seconds) if collective.seconds else 0.0,
    }


async def _serve(ip: str) -> None:
    import multiaddr
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from lattica.net.host import build_host
    from lattica.net.tensors.transfer import TensorService, TensorServiceConfig

    torch.set_num_threads(1)
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    service = TensorService(host, key_pair, config=TensorServiceConfig())
    listen = [multiaddr.Multiaddr(f"/ip4/{ip}/tcp/0")]
    async with host.run(listen), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        _reply({"peer_id": service.peer_id, "addr": str(host.get_addrs()[0])})
        async for line in trio.wrap_file(sys.stdin):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "connect":
                for addr in cmd["addrs"]:
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                _reply({"ok": True, "op": "connect"})
            elif cmd["op"] == "train":
                _reply({"op": "train", **await _train(service, cmd)})
        nursery.cancel_scope.cancel()


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- the coordinator


def _run_lab(args: argparse.Namespace) -> dict:
    from lattica_lab.netlab import NetLab, shape_link

    results: dict[str, list[dict]] = {}
    with NetLab() as lab:
        hosts = [lab.add_public(f"p{i}") for i in range(args.workers)]
        for host in hosts:
            shape_link(host.ns, host.ifname, rate_mbit=args.rate_mbit)
        procs = [
            lab.spawn(
                h,
                [sys.executable, __file__, "--peer", "--ip", h.ip],
                stderr_path=f"{args.log_dir}/overlap-{h.name}.log" if args.log_dir else None,
            )
            for h in hosts
        ]
        try:
            hellos = [p.wait_for(lambda e: "peer_id" in e, timeout=180) for p in procs]
            for i, proc in enumerate(procs):
                proc.send({"op": "connect", "addrs": [h["addr"] for h in hellos[i + 1 :]]})
                proc.wait_for(lambda e: e.get("op") == "connect", timeout=60, fresh=True)
        except (TimeoutError, RuntimeError) as exc:
            raise BenchmarkFailed(f"the peers did not start and connect: {exc}") from None
        peers = [h["peer_id"] for h in hellos]
        for cycle, name in [(c, n) for c in range(args.cycles) for n in args.strategies]:
            for i, proc in enumerate(procs):
                proc.send(
                    {
                        "op": "train",
                        "strategy": name,
                        "peers": peers,
                        "steps": args.steps,
                        "inner_steps": args.inner_steps,
                        "overlap_steps": args.overlap_steps,
                        "seed": i,
                    }
                )
            try:
                r = [
                    p.wait_for(lambda e: e.get("op") == "train", timeout=PHASE_TIMEOUT_S, fresh=True)
                    for p in procs
                ]
            except (TimeoutError, RuntimeError) as exc:
                raise BenchmarkFailed(f"{name} phase did not finish: {exc}") from None
            check_phase(name, r, args.steps, expected_syncs(name, args), args.workers)
            results.setdefault(name, []).extend(r)
            print(
                f"{name:<10} util {statistics.fmean(x['util'] for x in r):.3f}  "
                f"step {1000 * statistics.fmean(x['step_s'] for x in r):.1f} ms "
                f"(CPU {1000 * statistics.fmean(x['step_cpu_s'] for x in r):.1f} ms)  "
                f"other CPU {statistics.fmean(x['other_cpu_s'] for x in r):.2f}s  "
                f"waits/step {statistics.fmean(x['step_waits'] for x in r):.2f}  "
                f"wall {statistics.fmean(x['wall_s'] for x in r):.1f}s  "
                f"MB sent/peer {statistics.fmean(x['bytes_sent'] for x in r) / 1e6:.2f}  "
                f"comm {statistics.fmean(x['comm_s'] for x in r):.3f}s per call, "
                f"window {_window_s(name, args, r):.3f}s",
                flush=True,
            )
            if name == args.strategies[-1]:
                print(cycle_line(results, args, cycle), flush=True)
        for proc in procs:
            proc.send({"op": "quit"})
    return results


def _window_s(name: str, args: argparse.Namespace, rows: list[dict]) -> float:
    """Inner-step time the strategy lets one sync overlap (none for blocking DiLoCo)."""
    steps = {"nocomm": 0, "diloco": 0, "eager": args.inner_steps, "streaming": args.overlap_steps,
             "co2": args.inner_steps}
    return steps[name] * statistics.fmean(r["step_s"] for r in rows)


def expected_syncs(name: str, args: argparse.Namespace) -> int:
    """Completed syncs one peer must report: a round per H steps; Streaming: every fragment
    sync started (all are applied by the end of training)."""
    from lattica.train.strategies.streaming import sync_due

    if name == "nocomm":
        return 0
    if name == "streaming":
        h = args.inner_steps
        return sum(
            sync_due(step, p, inner_steps=h, fragments=FRAGMENTS)
            for step in range(1, args.steps + 1)
            for p in range(FRAGMENTS)
        )
    return args.steps // args.inner_steps


def check_phase(name: str, rows: list[dict], steps: int, syncs: int, workers: int) -> None:
    """Raise ``BenchmarkFailed`` unless every peer trained every step and completed its syncs."""
    if not rows or len(rows) % workers:
        raise BenchmarkFailed(f"{name}: {len(rows)} peer reports, not a multiple of {workers}")
    for i, row in enumerate(rows):
        if not row.get("ok"):
            raise BenchmarkFailed(f"{name}: peer {i} did not finish: {row.get('error', row)}")
        if row.get("steps") != steps:
            raise BenchmarkFailed(f"{name}: peer {i} trained {row.get('steps')} of {steps} steps")
        if row.get("skipped_syncs"):
            raise BenchmarkFailed(f"{name}: peer {i} skipped {row['skipped_syncs']} sync(s)")
        if row.get("syncs", 0) < syncs:
            raise BenchmarkFailed(f"{name}: peer {i} completed {row.get('syncs')} of {syncs} syncs")
        if not row.get("wall_s", 0) > 0:
            raise BenchmarkFailed(f"{name}: peer {i} reported no wall time")


def cycle_walls(rows: list[dict], workers: int) -> list[float]:
    """Each cycle's wall (the mean over the peers), in the order the cycles ran."""
    return [statistics.fmean(r["wall_s"] for r in rows[i : i + workers]) for i in range(0, len(rows), workers)]


def best_cycle_wall(rows: list[dict], workers: int) -> float:
    """The shortest of the cycles' walls: load from other work only ever lengthens a phase, so
    like ``timeit`` the best cycle is the least disturbed."""
    return min(cycle_walls(rows, workers))


def paired_ratios(reference: list[dict], rows: list[dict], workers: int) -> list[float]:
    """Per cycle, the reference's wall over the strategy's, both measured in that cycle: load
    that drifts between cycles (the no-communication run's steps too) moves both sides alike."""
    pairs = zip(cycle_walls(reference, workers), cycle_walls(rows, workers), strict=True)
    return [ref / wall for ref, wall in pairs]


def paired_ratio(reference: list[dict], rows: list[dict], workers: int) -> float:
    """The median over cycles of ``paired_ratios``: one cycle hit by a load spike does not
    decide it."""
    return statistics.median(paired_ratios(reference, rows, workers))


def _ratio_names(name: str, strategies: list[str]) -> list[tuple[str, str, str]]:
    """(JSON key, reference strategy, short label) of the ratios reported for ``name``."""
    if name == "nocomm":
        return []
    user = "blocking" if name == "diloco" else name
    ratios = [(f"{user}_util_vs_nocomm", "nocomm", "vs nocomm")]
    if name != "diloco" and "diloco" in strategies:
        ratios.append((f"{name}_speedup_vs_blocking", "diloco", "speedup vs blocking"))
    return ratios


def cycle_line(results: dict[str, list[dict]], args: argparse.Namespace, cycle: int) -> str:
    """The paired ratios of one completed cycle, as a line of the table."""
    w = args.workers
    parts = []
    for name in args.strategies:
        for _, reference, label in _ratio_names(name, args.strategies):
            rows = results[name][cycle * w : (cycle + 1) * w]
            ratio = paired_ratio(results[reference][cycle * w : (cycle + 1) * w], rows, w)
            parts.append(f"{name} {label} {ratio:.3f}")
    return f"cycle {cycle + 1}: " + ", ".join(parts)


def summarize(results: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The JSON figures; raises ``BenchmarkFailed`` when a phase is missing or unfinished."""
    for name in args.strategies:
        if len(results.get(name, [])) != args.workers * args.cycles:
            raise BenchmarkFailed(f"{name}: the phase did not run {args.cycles} time(s)")
        check_phase(name, results[name], args.steps, expected_syncs(name, args), args.workers)
    key = {"diloco": "blocking_util", "eager": "eager_util", "streaming": "streaming_util"}
    out = {
        "link": f"tbf {args.rate_mbit} Mbit/s egress per peer (netns lab)",
        "workers": args.workers,
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "streaming_fragments": FRAGMENTS,
        "streaming_overlap_steps": args.overlap_steps,
        "cycles": args.cycles,
    }
    walls = {name: best_cycle_wall(rows, args.workers) for name, rows in results.items()}
    for name, rows in results.items():
        out[key.get(name, f"{name}_util")] = round(statistics.fmean(r["util"] for r in rows), 4)
        out[f"{name}_wall_s"] = round(walls[name], 2)
        out[f"{name}_bytes_per_peer"] = int(statistics.fmean(r["bytes_sent"] for r in rows))
        out[f"{name}_comm_s"] = round(statistics.fmean(r["comm_s"] for r in rows), 3)
        # inner steps slow down when communication competes for the cores (and the GIL)
        out[f"{name}_step_ms"] = round(1000 * statistics.fmean(r["step_s"] for r in rows), 1)
        # CPU, which load from other processes does not inflate: the training thread's per
        # inner step, and the rest of the process (communication, codecs, outer steps)
        out[f"{name}_step_cpu_ms"] = round(1000 * statistics.fmean(r["step_cpu_s"] for r in rows), 1)
        out[f"{name}_other_cpu_s"] = round(statistics.fmean(r["other_cpu_s"] for r in rows), 2)
        # times per inner step the training thread blocked (mostly: waiting for the GIL while
        # the event loop thread runs communication)
        out[f"{name}_step_waits"] = round(statistics.fmean(r["step_waits"] for r in rows), 2)
        if name in ("eager", "streaming", "co2"):
            out[f"{name}_window_s"] = round(_window_s(name, args, rows), 3)
        for key_name, reference, _ in _ratio_names(name, list(results)):
            out[key_name] = round(paired_ratio(results[reference], rows, args.workers), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ip", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument(
        "--workers", type=int, default=WORKERS,
        help="peers (each trains on one thread: more peers than cores share the cores)",
    )
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="egress cap per peer")
    parser.add_argument("--steps", type=int, default=240, help="inner steps per strategy")
    parser.add_argument("--inner-steps", type=int, default=40, help="H")
    parser.add_argument("--overlap-steps", type=int, default=5, help="Streaming's tau")
    parser.add_argument("--strategies", default="nocomm,diloco,eager,streaming")
    parser.add_argument(
        "--cycles", type=int, default=1,
        help="run the strategies in turn this many times (load from other work hits all alike)",
    )
    parser.add_argument("--log-dir", default="", help="write each peer's stderr here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.peer:
        import trio

        trio.run(_serve, args.ip)
        return 0
    from lattica_lab.netlab import lab_unavailable_reason

    reason = lab_unavailable_reason()
    if reason:
        print(f"error: the NAT lab is unavailable here: {reason}", file=sys.stderr)
        return 2
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if "nocomm" not in args.strategies:  # the reference of every *_util_vs_nocomm
        args.strategies.insert(0, "nocomm")
    print(
        f"{args.workers} peers in network namespaces, tbf egress cap {args.rate_mbit} Mbit/s each, "
        f"tiny GPT, {args.steps} steps, H={args.inner_steps}, streaming P=2 tau="
        f"{args.overlap_steps} fp4",
        flush=True,
    )
    try:
        out = summarize(_run_lab(args), args)
    except BenchmarkFailed as exc:
        print(f"overlap benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
