"""DiLoCo's outer step with its state on the host or on the training device: bits, time, memory.

Two in-memory replicas of a preset, on ``--device``, take ``--rounds`` DiLoCo rounds; before
each round every replica's weights take a deterministic random step of their own (drawn on the
CPU from a seeded generator, the same values whatever the device). The run is repeated three
times: with the outer state on the host (``outer_state_device = "cpu"``, pinned on CUDA), on
the training device (``"same"``), and as a member that trains on the CPU would (models on the
CPU). Reported:

- ``cpu_matches_cpu_member``: the host placement on ``--device`` gives the outer weights of a
  CPU-only member, bit for bit (the math is the same CPU math; θ only travels);
- ``same_matches_cpu_member``: the outer step computed on the device gives them too (on CUDA
  this depends on the device's arithmetic: informative, not a promise);
- per placement: the median wall time of one outer round (pseudo-gradient, all-reduce, Nesterov
  step, θ ← φ) and ``extra_device_bytes``, the device memory the strategy adds through its
  rounds (CUDA: the allocator's peak above what was allocated before it; CPU: null).

    python benchmarks/outer_placement.py [--preset medium] [--device auto|cpu|cuda] [--rounds 3]

Last line: one JSON object. A run that does not finish fails: exit status 1, one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)
import torch
import trio

from lattica.errors import ConfigError
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.device import select_device
from lattica.train.engine.model import build_model
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

PEERS = ("a", "b")
NUDGE = 1e-3


class FixedGroups:
    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = members

    async def group_for(self, key: str) -> tuple[str, ...]:
        return self.members


def run_rounds(preset: str, device: torch.device, where: str, rounds: int) -> dict[str, Any]:
    """``rounds`` outer rounds of two replicas; the outer weights' hash, round times, memory."""
    models = [build_model(preset, seed=0).to(device) for _ in PEERS]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    network = InMemoryCollectiveGroup(PEERS)
    config = DiLoCoConfig(inner_steps=1, outer_state_device=where)
    strategies = [
        DiLoCo(m, collective=network.member(p), groups=FixedGroups(PEERS), config=config)
        for m, p in zip(models, PEERS, strict=True)
    ]
    generators = [torch.Generator().manual_seed(10 + i) for i in range(len(PEERS))]
    seconds = []
    for _ in range(rounds):
        for model, generator in zip(models, generators, strict=True):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator).to(device), alpha=NUDGE)
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        trio.run(_sync_all, strategies)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    hashes = {weights_hash(s.outer_state_dict()["params"]) for s in strategies}
    if len(hashes) != 1:
        raise RuntimeError(f"the replicas disagree after {rounds} rounds ({where} on {device})")
    extra = int(torch.cuda.max_memory_allocated(device) - before) if cuda else None
    return {"hash": hashes.pop(), "round_s": statistics.median(seconds) / len(PEERS), "extra_device_bytes": extra}


async def _sync_all(strategies: list[DiLoCo]) -> None:
    async with trio.open_nursery() as nursery:
        for strategy in strategies:
            nursery.start_soon(strategy.sync)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        device = select_device(args.device)
        results = {where: run_rounds(args.preset, device.device, where, args.rounds) for where in ("cpu", "same")}
        member = run_rounds(args.preset, torch.device("cpu"), "cpu", args.rounds)
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"outer placement benchmark failed: {exc}", file=sys.stderr)
        return 1
    for where, r in results.items():
        print(f"{where:>5}: {r['round_s'] * 1e3:8.1f} ms per replica's outer round, "
              f"extra device bytes {r['extra_device_bytes']}, hash {r['hash'][:16]}")
    print(f"cpu-only member: hash {member['hash'][:16]}")
    summary = {
        "device": device.describe(),
        "preset": args.preset,
        "rounds": args.rounds,
        "cpu_matches_cpu_member": results["cpu"]["hash"] == member["hash"],
        "same_matches_cpu_member": results["same"]["hash"] == member["hash"],
        "placements": {
            where: {"round_s": round(r["round_s"], 5), "extra_device_bytes": r["extra_device_bytes"]}
            for where, r in results.items()
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
