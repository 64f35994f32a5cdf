"""N real ``lattica join --train`` daemons on this machine, training together by gossip.

    nice -n 10 .venv/bin/python benchmarks/swarm_real.py --daemons 8
    nice -n 10 .venv/bin/python benchmarks/swarm_real.py           # 64

The first daemon starts a run; the others join it from its address alone, ``--batch`` at a time
(each waits until its control socket answers). Every daemon trains the ``tiny`` model on the
CPU (one intra-op thread, batch 4, sequences of 32 tokens, ``--inner-steps`` inner steps a
round) and averages by gossip (``--averaging gossip``, DiLoCo), ``--rounds`` rounds; training
starts once ``--daemons`` members are live (``--min-peers``). Measured:

- ``joined``: the most live members the first daemon's replicated state showed;
- ``rounds_completed_min``: the fewest rounds any daemon completed;
- ``rss_mb_per_daemon`` (mean) and ``rss_mb_max``: resident memory, sampled every few seconds
  while the daemons train, each daemon's peak; ``pss_mb_per_daemon``: the same for the
  proportional set size (shared library pages divided among the daemons that map them);
- ``state_bytes``: the replicated state the first daemon holds (its replica's envelopes), at
  the end; ``state_log_bytes`` its state log on disk.

A daemon that exits, fails to start or does not finish its rounds within ``--timeout-s`` fails
the run (exit status 1, one line on stderr, no figures). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica.cli.demo import stop_all
from lattica.errors import LatticaError
from lattica_lab.daemons import DaemonProcess
from lattica_lab.training_daemons import GOSSIP_ENV, train_args

TARGETS = {"rounds_completed_min": 3, "rss_mb_per_daemon": 150.0}


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident, proportional) MiB of a process: PSS shares the pages it maps with others (the
    same libraries in every daemon) among them, so PSS summed over the daemons is what they take."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0]) if rest.split() else 0
    return fields.get("Rss", 0) / 1024, fields.get("Pss", 0) / 1024


def _ask(daemon: DaemonProcess, method: str) -> dict[str, Any]:
    try:
        answer = daemon.call(method)
    except (LatticaError, OSError):
        return {}
    return answer if isinstance(answer, dict) else {}


def _rounds(daemon: DaemonProcess) -> int:
    training = _ask(daemon, "status").get("training") or {}
    if training.get("phase") == "failed":
        raise BenchmarkFailed(f"training failed in {daemon.data_dir}: {daemon.log()[-600:]}")
    return int(training.get("rounds_completed") or 0)


def start_swarm(base: Path, args: argparse.Namespace) -> list[DaemonProcess]:
    flags = (*train_args("diloco", rounds=args.rounds, inner_steps=args.inner_steps, min_peers=args.daemons),
             "--averaging", "gossip")
    first = DaemonProcess(base / "p0", extra_args=flags, env=GOSSIP_ENV).start()
    daemons = [first]
    first.wait_ready(120)
    for start in range(1, args.daemons, args.batch):
        batch = [DaemonProcess(base / f"p{i}", peers=(first.addr,), extra_args=flags, env=GOSSIP_ENV).start()
                 for i in range(start, min(start + args.batch, args.daemons))]
        daemons += batch
        for daemon in batch:
            daemon.wait_ready(180)
        print(f"{len(daemons)} daemons started", file=sys.stderr, flush=True)
    return daemons


def measure(daemons: list[DaemonProcess], args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.timeout_s
    peaks, pss_peaks = [0.0] * len(daemons), [0.0] * len(daemons)
    joined, rounds = 0, [0] * len(daemons)
    while min(rounds) < args.rounds:
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"rounds completed {sorted(rounds)} after {args.timeout_s} s")
        for i, daemon in enumerate(daemons):
            if daemon.proc is None or daemon.proc.poll() is not None:
                raise BenchmarkFailed(f"daemon {daemon.data_dir} exited: {daemon.log()[-600:]}")
            rss, pss = memory_mb(daemon.proc.pid)
            peaks[i], pss_peaks[i] = max(peaks[i], rss), max(pss_peaks[i], pss)
            rounds[i] = _rounds(daemon)
        joined = max(joined, len(_ask(daemons[0], "state").get("live") or []))
        print(f"rounds {min(rounds)}..{max(rounds)}, {joined} live", file=sys.stderr, flush=True)
        time.sleep(args.poll_s)
    node = _ask(daemons[0], "state").get("node") or {}
    return {
        "daemons": len(daemons),
        "joined": joined,
        "rounds_completed_min": min(rounds),
        "rss_mb_per_daemon": round(statistics.mean(peaks), 1),
        "rss_mb_max": round(max(peaks), 1),
        "pss_mb_per_daemon": round(statistics.mean(pss_peaks), 1),
        "state_bytes": node.get("state_bytes"),
        "state_log_bytes": node.get("log_bytes"),
        "model": "tiny",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemons", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="daemons started at a time")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="for the rounds, once all started")
    parser.add_argument("--poll-s", type=float, default=5.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout or a stop: the daemons are stopped first
    started = time.monotonic()
    daemons: list[DaemonProcess] = []
    try:
        with tempfile.TemporaryDirectory(prefix="swarm-real-") as tmp:
            try:
                daemons = start_swarm(Path(tmp), args)
                result = measure(daemons, args)
            finally:
                stop_all(daemons)
    except (BenchmarkFailed, RuntimeError, TimeoutError) as exc:
        print(f"swarm_real failed: {str(exc).splitlines()[0] if str(exc) else exc!r}", file=sys.stderr)
        return 1
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["targets_met"] = (
        result["joined"] == args.daemons
        and result["rounds_completed_min"] >= TARGETS["rounds_completed_min"]
        and result["rss_mb_per_daemon"] <= TARGETS["rss_mb_per_daemon"]
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
