"""All-reduce of 4 processes x 100 MB fp32 on loopback: Lattica's data plane against gloo.

Both sides reduce the same tensors (``randn`` from per-rank seeds) in the same run, timed the
same way: the input is ready before the clock starts, the group passes a barrier (gloo's
``barrier``; for Lattica a one-element all-reduce), and the mean is written over the input
(gloo's ``all_reduce`` then ``/= world``; Lattica's ``allreduce(out=[x])``). Lattica runs its
butterfly all-reduce between real peer processes over the encrypted fast path; gloo runs over
unencrypted TCP.

    .venv/bin/python benchmarks/allreduce.py [--peers 4] [--mb 100] [--reps 2]
    .venv/bin/python benchmarks/allreduce.py --peers 4,8,16     # one row per group size

Prints a table, then one JSON line with ``allreduce_s``, ``gloo_s``, ``allreduce_vs_gloo``
(time ratio), ``cpu_vs_gloo`` and ``bytes_per_peer_vs_bound`` (bytes each peer sent /
2(N-1)/N of the payload) for the first group size; with several sizes also ``rows`` (the same
keys per size) and ``allreduce_vs_gloo_worst``.
Times are the slowest peer of the best repetition; ``*_cpu_s`` is the CPU time of the busiest
process in it (gloo's includes its I/O threads), and ``load_avg_1m`` tells how shared the
machine was while it ran.

A repetition that fails on either side (a peer or gloo worker exits, misses its deadline or
reports no result) fails the run: exit status 1 and one line on stderr, no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.peer_driver import run_all, spawn_peers


class BenchmarkFailed(RuntimeError):
    """A repetition did not finish: the benchmark reports no figures."""


def check_replies(side: str, replies: list[dict], world: int) -> None:
    """Raise ``BenchmarkFailed`` unless all ``world`` members reported a finished repetition."""
    if len(replies) != world:
        raise BenchmarkFailed(f"{side}: {len(replies)} of {world} members reported")
    for i, reply in enumerate(replies):
        if not reply.get("ok", True) or not reply.get("seconds", 0) > 0:
            raise BenchmarkFailed(f"{side}: member {i} did not finish: {reply}")


def _gloo_worker(rank: int, world: int, port: int, numel: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    x = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    times, cpu = [], []
    for _ in range(reps):
        buf = x.clone()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        dist.all_reduce(buf)
        buf /= world
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    print(json.dumps({"times": times, "cpu": cpu}), flush=True)
    dist.destroy_process_group()


def gloo_seconds(world: int, numel: int, reps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); from allreduce import _gloo_worker;"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code + f"_gloo_worker({r}, {world}, {port}, {numel}, {reps})"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        for r in range(world)
    ]
    try:
        results = []
        for rank, p in enumerate(procs):
            out = p.communicate(timeout=600)[0].strip().splitlines()
            if p.returncode != 0 or not out:
                raise BenchmarkFailed(f"gloo: rank {rank} exited with status {p.returncode}")
            results.append(json.loads(out[-1]))
    except subprocess.TimeoutExpired:
        raise BenchmarkFailed("gloo: a rank did not finish in 600 s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for i in range(reps):
        check_replies("gloo", [{"seconds": r["times"][i]} for r in results], world)
    best = min(range(reps), key=lambda i: max(r["times"][i] for r in results))
    return max(r["times"][best] for r in results), max(r["cpu"][best] for r in results)


def lattica_seconds(world: int, numel: int, reps: int) -> tuple[float, float, int]:
    with spawn_peers(world) as peers:
        group = [p.peer_id for p in peers]
        best, cpu, sent = float("inf"), 0.0, 0
        for rep in range(reps + 1):  # rep 0 is a small warm-up (sets up the fast channels)
            n = 4096 if rep == 0 else numel
            cmds = [
                {"op": "allreduce", "group": group, "tag": f"bench{rep}", "numel": n,
                 "seed": 100 + i, "deadline_s": 300.0, "out": None, "barrier": True, "inplace": True}
                for i in range(world)
            ]
            try:
                replies = run_all(peers, cmds, timeout=400)
            except (TimeoutError, EOFError) as exc:
                raise BenchmarkFailed(f"lattica: a peer did not finish: {exc}") from None
            try:
                check_replies("lattica", replies, world)
            except BenchmarkFailed as exc:  # what the failed members logged says why
                logs = [f"member {i}: {p.error_log()[-600:]}" for i, p in enumerate(peers)
                        if not replies[i].get("ok", True)] if len(replies) == world else []
                raise BenchmarkFailed(f"{exc}; {' | '.join(logs)}") from None
            if rep and max(r["seconds"] for r in replies) < best:
                best = max(r["seconds"] for r in replies)
                cpu = max(r["cpu_s"] for r in replies)
                sent = max(r["bytes_sent"] for r in replies)
        return best, cpu, sent


def measure(peers: int, mb: int, reps: int) -> dict:
    """One row: both sides for a group of ``peers`` (raises ``BenchmarkFailed``)."""
    numel = mb * 1_000_000 // 4
    ours, ours_cpu, sent = lattica_seconds(peers, numel, reps)
    gloo, gloo_cpu = gloo_seconds(peers, numel, reps)
    bound = 2 * (peers - 1) / peers * numel * 4
    return {
        "peers": peers,
        "mb": mb,
        "allreduce_s": round(ours, 3),
        "gloo_s": round(gloo, 3),
        "allreduce_vs_gloo": round(ours / gloo, 3),
        "allreduce_cpu_s": round(ours_cpu, 3),
        "gloo_cpu_s": round(gloo_cpu, 3),
        "cpu_vs_gloo": round(ours_cpu / gloo_cpu, 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "bytes_per_peer_vs_bound": round(sent / bound, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", default="4", help="group sizes, comma-separated (e.g. 4,8,16)")
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    try:
        sizes = [int(p) for p in args.peers.split(",")]
    except ValueError:
        parser.error("--peers takes group sizes separated by commas, e.g. 4,8,16")
    if min(sizes) < 2 or args.mb < 1 or args.reps < 1:
        parser.error("--peers must be at least 2, --mb and --reps at least 1")
    rows = []
    try:
        for peers in sizes:
            rows.append(measure(peers, args.mb, args.reps))
    except BenchmarkFailed as exc:
        print(f"allreduce benchmark failed ({sizes[len(rows)]} peers): {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"{'peers':>5}  {'implementation':<28}{'seconds':>10}{'cpu s/peer':>12}")
    for row in rows:
        for name, key in (("lattica butterfly (fast)", "allreduce"), ("torch.distributed gloo", "gloo")):
            print(f"{row['peers']:>5}  {name:<28}{row[key + '_s']:>10.3f}{row[key + '_cpu_s']:>12.3f}")
    summary = dict(rows[0])
    if len(rows) > 1:
        summary["rows"] = rows
        summary["allreduce_vs_gloo_worst"] = max(r["allreduce_vs_gloo"] for r in rows)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
