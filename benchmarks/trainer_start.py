"""The CPU a trainer needs from its build to its first round, in a fresh interpreter.

What a (re)started member spends after its imports and before it contributes, the network left
out: the daemon's trainer factory builds the chaos benchmark's trainer (tiny model, DiLoCo, CPU,
batch 4 × 32 tokens, 10 inner steps, ``OMP_NUM_THREADS=1``) over a small corpus and runs its first
round alone (an in-memory collective of one). Each repeat is a new ``python`` process, so every
lazy import the first round triggers is counted; the imports of torch and lattica before the
build are not. Figures, medians over ``--repeats``:

- ``first_round_cpu_s``: user + system CPU seconds of the process from the build to the end of
  the first round;
- ``first_round_s``: the wall time of the same;
- ``dynamo_imported``: whether ``torch._dynamo`` was imported by then (in any repeat).

A repeat that fails fails the run (exit 1, one line on stderr). Last line: one JSON object.

    nice -n 5 .venv/bin/python benchmarks/trainer_start.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_ONE_START = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
import trio
from lattica.config import TrainSettings
from lattica.train.settings import trainer_factory
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

cpu0, wall0 = cpu(), time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    corpus = Path(tmp) / "corpus.txt"
    corpus.write_text("a small corpus for a first round of training. " * 4000)
    settings = TrainSettings(strategy="diloco", model="tiny", data=str(corpus), inner_steps=10, rounds=1,
                             device="cpu", warmup_steps=2, batch_size=4, seq_len=32)
    group = InMemoryCollectiveGroup(["me"])
    parts = trainer_factory.TrainerParts(peer_id="me", collective=group.member("me"), groups=FixedGroups(["me"]),
                                         checkpoint_dir=Path(tmp) / "checkpoints")
    trio.run(trainer_factory.build_trainer(settings, parts).run)
print(json.dumps({"cpu_s": cpu() - cpu0, "wall_s": time.perf_counter() - wall0,
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def one_start(root: Path) -> dict[str, float | bool]:
    done = subprocess.run(
        [sys.executable, "-c", _ONE_START], cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    result: dict[str, float | bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]  # the checkout: its lattica and lattica_lab
    try:
        runs = [one_start(root) for _ in range(args.repeats)]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"trainer start benchmark failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({
        "first_round_cpu_s": round(statistics.median(float(r["cpu_s"]) for r in runs), 2),
        "first_round_s": round(statistics.median(float(r["wall_s"]) for r in runs), 2),
        "dynamo_imported": any(bool(r["dynamo"]) for r in runs),
        "repeats": args.repeats,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
