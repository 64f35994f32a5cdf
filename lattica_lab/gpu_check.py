"""One prepared check of Lattica on a machine with a GPU (``scripts/gpu_check.sh`` runs it).

Loopback only, nothing downloaded; about five minutes on one GPU. The phases, each a process of
its own with a time limit (a phase that runs over is ended, with everything it started, and
counts as failed):

1. ``throughput`` (alone, so nothing else loads the GPU): ``benchmarks/throughput.py`` on
   ``gpt2-124m`` (32 × 1024) and ``gpt-350m`` (16 × 1024): the product's trainer against the
   compiled plain loop, tokens/s, MFU, peak memory, the outer state's device memory;
2. then side by side:
   - ``daemons``: ``lattica demo`` with two real daemons training ``small`` on the GPU (two
     rounds of 50 inner steps), which checks that their replicas hold identical weights;
   - ``convergence``: ``benchmarks/convergence.py --device cuda``, DiLoCo against DDP from
     scratch on ``medium``, 4 workers × 2,000 steps (eager: compiling would take the budget);
   - ``placement``: ``benchmarks/outer_placement.py``, the outer state on the host and on the
     device, the same bits as a CPU member, round times and device memory.

``--ranks`` checks a node of several devices instead (``train.devices``; a machine with two
GPUs or more, about four minutes): ``ranks_throughput`` (``benchmarks/throughput.py
--devices auto`` on ``gpt2-124m``: ``multi_vs_single``, target >= 0.9 with NCCL) alone, then
``ranks_daemons`` (``lattica demo`` with two daemons, each on every GPU with
``devices = "auto"``, replicas identical). ``--ranks --device cpu --quick`` is its dry run
with two CPU ranks per node.

``--device cpu --quick`` runs the same phases with the smallest settings on the CPU: a dry run
that shows the check itself works before a GPU is spent on it. The last line printed is one
JSON object: ``ok``, the device, torch's version, and per phase ``ok``, ``seconds``, the phase's
own last JSON line (``result``) and, when it failed, the end of its output (``error``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_ERROR_TAIL = 1500
_POLL_S = 0.2


@dataclass(frozen=True)
class Phase:
    name: str
    args: tuple[str, ...]  # after the interpreter
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


def plan(device: str, *, quick: bool, ranks: bool = False) -> list[list[Phase]]:
    """Groups of phases: the groups one after the other, the phases of a group side by side."""
    bench = "benchmarks"
    if ranks:
        return ranks_plan(device, quick=quick)
    if quick:
        return [
            [Phase("throughput", (f"{bench}/throughput.py", "--presets", "tiny", "--device", device,
                                  "--steps", "2", "--reps", "1", "--warmup", "2"), 120)],
            [
                Phase("daemons", ("-m", "lattica.cli.main", "demo", "--nodes", "2", "--rounds", "1",
                                  "--inner-steps", "5", "--model", "tiny", "--json"), 150,
                      {"LATTICA_TRAIN_DEVICE": device}),
                Phase("convergence", (f"{bench}/convergence.py", "--device", device, "--model", "tiny",
                                      "--strategies", "ddp,diloco", "--steps", "50", "--workers", "2",
                                      "--batch-size", "2", "--context", "32", "--eval-batches", "2"), 150),
                Phase("placement", (f"{bench}/outer_placement.py", "--preset", "tiny", "--device", device,
                                    "--rounds", "2"), 60),
            ],
        ]
    return [
        [Phase("throughput", (f"{bench}/throughput.py", "--presets", "gpt2-124m,gpt-350m", "--device", device,
                              "--steps", "10", "--reps", "3", "--warmup", "10"), 160)],
        [
            Phase("daemons", ("-m", "lattica.cli.main", "demo", "--nodes", "2", "--rounds", "2",
                              "--inner-steps", "50", "--model", "small", "--json"), 140,
                  {"LATTICA_TRAIN_DEVICE": device}),
            Phase("convergence", (f"{bench}/convergence.py", "--device", device, "--model", "medium",
                                  "--strategies", "ddp,diloco", "--steps", "2000", "--workers", "4",
                                  "--batch-size", "16", "--context", "256", "--eval-batches", "8",
                                  "--compile", "false"), 140),
            Phase("placement", (f"{bench}/outer_placement.py", "--preset", "medium", "--device", device,
                                "--rounds", "3"), 90),
        ],
    ]


def ranks_plan(device: str, *, quick: bool) -> list[list[Phase]]:
    """The phases of ``--ranks`` (module docstring)."""
    devices = "cpu:2" if device == "cpu" else "auto"
    env = {"LATTICA_TRAIN_DEVICE": device, "LATTICA_TRAIN_DEVICES": devices}
    if quick:
        return [
            [Phase("ranks_throughput", ("benchmarks/throughput.py", "--presets", "tiny", "--device", device,
                                        "--devices", devices, "--steps", "2", "--reps", "1", "--warmup", "2"), 150)],
            [Phase("ranks_daemons", ("-m", "lattica.cli.main", "demo", "--nodes", "2", "--rounds", "1",
                                     "--inner-steps", "5", "--model", "tiny", "--json"), 150, env)],
        ]
    return [
        [Phase("ranks_throughput", ("benchmarks/throughput.py", "--presets", "gpt2-124m", "--device", device,
                                    "--devices", devices, "--steps", "10", "--reps", "3", "--warmup", "10"), 170)],
        [Phase("ranks_daemons", ("-m", "lattica.cli.main", "demo", "--nodes", "2", "--rounds", "2",
                                 "--inner-steps", "50", "--model", "small", "--json"), 130, env)],
    ]


def last_json_line(text: str) -> Any:
    """The last line of ``text`` that parses as a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def phase_record(*, returncode: int | None, seconds: float, output: str, timed_out: bool) -> dict[str, Any]:
    """What the summary says about one phase: ok only when it exited 0, in time, with a JSON
    line whose own ``ok`` (where it has one) is not false."""
    result = last_json_line(output)
    ok = returncode == 0 and not timed_out and isinstance(result, dict) and result.get("ok", True) is not False
    record: dict[str, Any] = {"ok": ok, "seconds": round(seconds, 1), "result": result}
    if not ok:
        reason = "timed out" if timed_out else f"exit status {returncode}"
        record["error"] = f"{reason}: {output.strip()[-_ERROR_TAIL:]}"
    return record


class RunningPhase:
    """One phase as a process group of its own (ended as a whole when it runs over)."""

    def __init__(self, phase: Phase, workdir: Path) -> None:
        self.phase = phase
        self.output = workdir / f"{phase.name}.log"
        self.started = time.monotonic()
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *phase.args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, **phase.env}, start_new_session=True,
            )

    def outcome(self) -> dict[str, Any] | None:
        """The phase's record once it exited or ran over its time; None while it runs."""
        seconds = time.monotonic() - self.started
        timed_out = self.proc.poll() is None and seconds > self.phase.timeout_s
        if self.proc.poll() is None and not timed_out:
            return None
        self._end_group()  # a phase that ran over, or what it left running (a daemon of the demo)
        return phase_record(
            returncode=self.proc.returncode, seconds=seconds,
            output=self.output.read_text(errors="replace"), timed_out=timed_out,
        )

    def _end_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this phase's process leads
        self.proc.wait()


def run(groups: list[list[Phase]]) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lattica-gpu-check-") as tmp:
        for group in groups:
            running = [RunningPhase(phase, Path(tmp)) for phase in group]
            try:
                while running:
                    for phase in list(running):
                        record = phase.outcome()
                        if record is not None:
                            running.remove(phase)
                            records[phase.phase.name] = record
                            state = "ok" if record["ok"] else "FAILED"
                            print(f"{phase.phase.name}: {state} in {record['seconds']} s", flush=True)
                    time.sleep(_POLL_S)
            finally:
                for phase in running:  # interrupted: nothing is left behind
                    phase._end_group()
    return records


def _device_facts(device: str) -> dict[str, Any]:
    import torch

    from lattica.train.engine.device import select_device

    facts: dict[str, Any] = {"torch": torch.__version__}
    try:
        facts["device"] = select_device(device).describe()
    except Exception as exc:  # noqa: BLE001 - reported, the phases say the rest
        facts["device"] = f"unavailable: {exc}"
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="the smallest settings: a dry run")
    parser.add_argument("--ranks", action="store_true", help="a node of several devices (two GPUs or more)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    facts = _device_facts(args.device)
    print(f"gpu check on {facts['device']} (torch {facts['torch']}){' quick' if args.quick else ''}", flush=True)
    records = run(plan(args.device, quick=args.quick, ranks=args.ranks))
    summary = {
        "ok": all(r["ok"] for r in records.values()),
        **facts,
        "quick": args.quick,
        "ranks": args.ranks,
        "seconds": round(time.monotonic() - started, 1),
        "phases": records,
    }
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
