"""Daemon start-up time and idle memory.

Starts a bootstrap daemon, then a second daemon joining it, and measures:
- ``startup_s``: from spawning the second process to its first connected peer (control socket
  polled every 20 ms);
- ``idle_rss_mb``: the joined daemon's resident memory after it has idled for a few seconds;
- ``bare_python_rss_mb``: a bare ``python -c "import trio"`` process, measured in the same run.
Targets: idle_rss_mb <= 150, startup_s <= 3. Last line: one JSON object.

A daemon that does not start, or a joiner that never connects within 60 s, fails the run: exit
status 1 and one line on stderr, no figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica.errors import LatticaError
from lattica_lab.daemons import DaemonProcess

CONNECT_TIMEOUT_S = 60.0


class BenchmarkFailed(RuntimeError):
    """A start-up did not finish: the benchmark reports no figures."""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def bare_python_rss() -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import trio, sys; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the bare interpreter did not start")
    value = rss_mb(proc.pid)
    proc.communicate("", timeout=10)
    return value


def one_startup(root: Path, bootstrap: str, idle_s: float) -> tuple[float, float]:
    joiner = DaemonProcess(root, peers=(bootstrap,))
    started = time.monotonic()
    joiner.start()
    try:
        while True:
            if time.monotonic() - started > CONNECT_TIMEOUT_S:
                tail = " | ".join(joiner.log().strip().splitlines()[-3:])
                raise BenchmarkFailed(f"the joiner had no connected peer after {CONNECT_TIMEOUT_S:.0f} s: {tail}")
            try:
                if any(p["connected"] for p in joiner.call("peers")):
                    break
            except LatticaError:
                pass
            time.sleep(0.02)
        startup = time.monotonic() - started
        time.sleep(idle_s)
        assert joiner.proc is not None
        return startup, rss_mb(joiner.proc.pid)
    finally:
        joiner.stop()


def startups(repeats: int, idle_s: float) -> list[tuple[float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bootstrap = DaemonProcess(root / "bootstrap").start()
        try:
            bootstrap.wait_ready()
            addr = bootstrap.addr
            return [one_startup(root / f"joiner{i}", addr, idle_s) for i in range(repeats)]
        finally:
            bootstrap.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle", type=float, default=5.0)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        runs = startups(args.repeats, args.idle)
        bare = bare_python_rss()
    except (BenchmarkFailed, LatticaError, RuntimeError, OSError) as exc:
        print(f"startup benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"{'run':>4} {'startup_s':>10} {'idle_rss_mb':>12}")
    for i, (s, r) in enumerate(runs):
        print(f"{i:>4} {s:>10.2f} {r:>12.1f}")
    print(f"bare python (import trio) rss: {bare:.1f} MB")
    result = {
        "startup_s": round(statistics.median(s for s, _ in runs), 3),
        "idle_rss_mb": round(statistics.median(r for _, r in runs), 1),
        "bare_python_rss_mb": round(bare, 1),
        "repeats": args.repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
