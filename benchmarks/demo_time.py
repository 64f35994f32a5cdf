"""Wall time of the default ``lattica demo`` (the README's first command after set-up).

Runs ``lattica demo --nodes 4 --json`` as a user would (four real ``lattica join --train``
daemons on loopback, the default rounds and inner steps) ``--repeats`` times and reports, per
run and as the median:
- ``demo_s``: from spawning ``lattica demo`` to its exit (start-up, loading, training, the
  identical-replicas check, shutdown); ``demo_s_max`` the slowest run;
- ``replicas_identical``: every replica ended on bit-identical outer weights (all runs);
- ``load_avg``: the machine's 1-minute load average before each run (the machine may be
  shared: read the time next to it);
- ``loss``: per run, node0's train loss at its first report and its final validation loss.
Target: demo_s <= 120 on 2 CPU cores. ``OMP_NUM_THREADS`` is removed from the demo's
environment: the figure is of the demo's own choice of threads, as a newcomer gets it.

A demo that exits non-zero, reports a node that did not finish or replicas that differ, or
runs past ``--timeout`` fails the run: exit status 1 and one line on stderr, no figures.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.daemons import lattica_command

TARGET_S = 120.0


class PhaseUnfinished(RuntimeError):
    """A demo run did not finish as it should: the benchmark reports no figures."""


def demo_figures(returncode: int, stdout: str, stderr: str) -> list[Mapping[str, object]]:
    """The demo's summary rows (one per node) from its closing JSON object, checked: every
    node done, replicas identical."""
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    tail = " | ".join(stderr.strip().splitlines()[-2:])
    if returncode != 0 or not isinstance(result, dict):
        raise PhaseUnfinished(f"the demo exited with {returncode} without its summary: {tail}")
    nodes = result.get("nodes")
    unfinished = [
        label for label, row in (nodes.items() if isinstance(nodes, dict) else [])
        if not isinstance(row, dict) or row.get("phase") != "done"
    ]
    if not nodes or unfinished:
        raise PhaseUnfinished(f"demo nodes did not finish: {', '.join(unfinished) or 'none reported'}")
    if result.get("replicas_identical") is not True or result.get("ok") is not True:
        raise PhaseUnfinished("the demo's replicas are not bit-identical")
    return list(nodes.values())


@dataclass(frozen=True)
class DemoRun:
    demo_s: float
    load_avg: float
    rounds: object
    first_loss: object
    val_loss: object


def one_run(nodes: int, timeout_s: float) -> DemoRun:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("LATTICA_")}
    load_avg = os.getloadavg()[0]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            lattica_command("demo", "--nodes", str(nodes), "--json"),
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )
    except subprocess.TimeoutExpired:
        raise PhaseUnfinished(f"the demo ran past {timeout_s:.0f} s") from None
    seconds = time.monotonic() - started
    first = demo_figures(proc.returncode, proc.stdout, proc.stderr)[0]
    return DemoRun(
        demo_s=round(seconds, 1), load_avg=round(load_avg, 2), rounds=first.get("rounds"),
        first_loss=_rounded(first.get("first_loss")), val_loss=_rounded(first.get("val_loss")),
    )


def _rounded(loss: object) -> object:
    return round(loss, 4) if isinstance(loss, float) else loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one demo may run")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        runs = [one_run(args.nodes, args.timeout) for _ in range(args.repeats)]
    except (PhaseUnfinished, OSError) as exc:
        print(f"demo benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"{'run':>4} {'demo_s':>8} {'load_avg':>9} {'rounds':>7} {'first_loss':>11} {'val_loss':>9}")
    for i, r in enumerate(runs):
        print(f"{i:>4} {r.demo_s:>8} {r.load_avg:>9} {r.rounds!s:>7} {r.first_loss!s:>11} {r.val_loss!s:>9}")
    times = [r.demo_s for r in runs]
    result = {
        "demo_s": round(statistics.median(times), 1),
        "demo_s_max": max(times),
        "replicas_identical": True,  # every run checked (demo_figures)
        "load_avg": [r.load_avg for r in runs],
        "loss": [[r.first_loss, r.val_loss] for r in runs],  # first report -> final validation
        "nodes": args.nodes,
        "repeats": args.repeats,
        "target_s": TARGET_S,
        "within_target": max(times) <= TARGET_S,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
