"""Daemon start-up time and idle memory.

Starts a bootstrap daemon, then a second daemon joining it, and measures:
- ``startup_s``: from spawning the second process to its first connected peer (control socket
  polled every 20 ms);
- ``idle_rss_mb``: the joined daemon's resident memory after it has idled for a few seconds;
- ``bare_python_rss_mb``: a bare ``python -c "import trio"`` process, measured in the same run.
Targets: idle_rss_mb <= 150, startup_s <= 3. Last line: one JSON object.
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

from lattica.errors import LatticaError
from lattica.testing.daemons import DaemonProcess


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
            if time.monotonic() - started > 60:
                raise TimeoutError(joiner.log())
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bootstrap = DaemonProcess(root / "bootstrap").start()
        try:
            bootstrap.wait_ready()
            addr = bootstrap.addr
            runs = [one_startup(root / f"joiner{i}", addr, args.idle) for i in range(args.repeats)]
        finally:
            bootstrap.stop()
    bare = bare_python_rss()
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
