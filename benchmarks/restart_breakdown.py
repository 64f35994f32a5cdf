"""Where a restarted training daemon's time goes, on loopback.

Starts ``--nodes`` (default two) ``lattica join --train`` daemons (tiny model, DiLoCo, CPU, the
chaos benchmark's training settings and ``min_peers``), lets them train a few rounds, SIGKILLs
the last one and restarts it with the same data dir and address (every other daemon as its
``--peer``), and stamps every line of the restarted daemon's output as it arrives
(``PYTHONUNBUFFERED``), with the CPU time the process used by then. Six nodes share the cores
as the chaos benchmark's do. The phases, in seconds from the restart's ``Popen``:

- ``up_s``: "lattica node … is up" (imports, host up, bootstrap, services started);
- ``resumed_s``: "resumed at step N" (the trainer built and its checkpoint loaded);
- ``adopted_s``: the first "adopted outer state" (the swarm's state fetched and taken);
- ``first_sync_s``: the first "sync round/N done with K member(s)", K ≥ 2, after the restart
  (its first contribution; a round run alone averages nothing);
- ``resumed_cpu_s``: the CPU seconds (user + system) the restarted process had used at ``resumed_s``.

Repeats ``--repeats`` restarts; last line: one JSON object with each phase's median. A daemon
that does not reach a phase within ``--timeout`` fails the run (exit 1, one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.daemons import DaemonProcess

TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "LATTICA_TRAIN_ROUND_DEADLINE_S": "5",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
PHASES = {
    "up_s": re.compile(r"lattica node \S+ is up"),
    "resumed_s": re.compile(r"resumed at step \d+"),
    "adopted_s": re.compile(r"adopted outer state of round"),
    "first_sync_s": re.compile(r"sync round/\d+ done with (?:[2-9]|\d{2,}) member"),
}


class BenchmarkFailed(RuntimeError):
    """A restart did not reach a phase: the benchmark reports no figures."""


class StampedDaemon(DaemonProcess):
    """A daemon whose output is read line by line and stamped with ``time.monotonic()``."""

    def start(self) -> StampedDaemon:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[tuple[float, str]] = []
        self.cpu: dict[int, float] = {}  # line index -> CPU seconds of the process when it came
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.environment(), text=True,
        )
        threading.Thread(target=self._read, args=(self.proc, self.lines, self.cpu), daemon=True).start()
        return self

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: list[tuple[float, str]], cpu: dict[int, float]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # a killed process's last lines stay in its own list
            if PHASES["resumed_s"].search(line):
                cpu[len(lines)] = cpu_seconds(proc.pid)
            lines.append((time.monotonic(), line.rstrip()))

    def phases(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for index, (stamp, line) in enumerate(list(self.lines)):
            for name, pattern in PHASES.items():
                if name not in found and pattern.search(line):
                    found[name] = round(stamp - self.started_at, 2)
                    if index in self.cpu:
                        found["resumed_cpu_s"] = round(self.cpu[index], 2)
        return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``); NaN when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_phases(daemon: StampedDaemon, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        phases = daemon.phases()
        if set(PHASES) <= set(phases):
            return phases
        time.sleep(0.1)
    tail = " | ".join(line for _, line in daemon.lines[-4:])
    raise BenchmarkFailed(f"the restarted daemon reached only {sorted(daemon.phases())} in {timeout:.0f} s: {tail}")


def measure(
    root: Path, repeats: int, timeout: float, show: bool = False, log_level: str = "info", nodes: int = 2,
) -> list[dict[str, float]]:
    """``nodes`` daemons (``min_peers`` all of them, as in the chaos benchmark); the last one is
    killed and restarted ``repeats`` times, with every other daemon as its ``--peer``."""
    train = (
        "--train", "--model", "tiny", "--device", "cpu", "--log-level", log_level,
        "--rounds", "100000", "--inner-steps", "10", "--min-peers", str(nodes),
    )
    env = TRAIN_ENV
    first = StampedDaemon(root / "n0", extra_args=train, env=env).start()
    daemons = [first]
    try:
        first.wait_ready(120)
        daemons += [
            StampedDaemon(root / f"n{i}", peers=(first.addr,), extra_args=train, env=env).start()
            for i in range(1, nodes)
        ]
        restarted = daemons[-1]
        wait_phases_named(restarted, "first_sync_s", timeout)
        others = tuple(d.addr for d in daemons[:-1])
        results = []
        for _ in range(repeats):
            time.sleep(3)  # a few rounds, so the checkpoint on disk is behind the swarm
            restarted.kill()
            restarted.peers = others
            restarted.start()
            results.append(wait_phases(restarted, timeout))
            if show:
                for who, daemon in (("r", restarted), ("0", first)):
                    for stamp, line in list(daemon.lines):
                        if stamp >= restarted.started_at - 1:
                            print(f"{who} {stamp - restarted.started_at:7.2f} {line[:160]}", flush=True)
            print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        for daemon in reversed(daemons):
            daemon.kill()


def wait_phases_named(daemon: StampedDaemon, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while name not in daemon.phases():
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"the second daemon never reached {name} in {timeout:.0f} s")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--show", action="store_true", help="print the restarted daemon's stamped output")
    parser.add_argument("--log-level", default="info", help="the daemons' log level (debug: every phase)")
    parser.add_argument("--nodes", type=int, default=2, help="daemons in the swarm (6: as contended as chaos)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lattica-restart-") as tmp:
        try:
            results = measure(Path(tmp), args.repeats, args.timeout, args.show, args.log_level, args.nodes)
        except BenchmarkFailed as exc:
            print(f"restart benchmark failed: {exc}", file=sys.stderr)
            return 1
    summary = {name: statistics.median(r[name] for r in results if name in r) for name in [*PHASES, "resumed_cpu_s"]}
    print(json.dumps({**summary, "nodes": args.nodes, "repeats": args.repeats, "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
