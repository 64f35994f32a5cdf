"""Chaos: real ``lattica join --train`` daemons under repeated SIGKILL, restart and partition.

Phase 1 (undisturbed): N daemons train DiLoCo (tiny model, short rounds) for R rounds.
Phase 2 (chaos): the same run again from fresh data dirs; every ``--kill-every`` seconds a random
peer (any of them, bootstrap included) is SIGKILLed and restarted with the same data dir, so it
resumes from its checkpoint and rejoins through any live peer; every ``--partition-every``-th
disturbance instead cuts one peer off for ``--partition-s`` seconds (SIGSTOP, then SIGCONT:
its connections stay up but nothing flows, as in a silent link cut) and heals it.

Measured: ``kills``; ``rounds_completed`` (the slowest replica at the end); ``lost_rounds`` (rounds
a peer had reported complete before a kill that it no longer had after restarting, summed);
``max_stall_s`` (the longest time the swarm's newest round did not advance, after the first
round); ``final_loss`` / ``undisturbed_loss`` (mean of the replicas' last training loss);
``replicas_identical`` (every replica reports the same weights hash at round R). Last line: JSON.

Loopback only: the partition is a process freeze, not a namespace link cut.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from lattica.errors import LatticaError
from lattica.testing.daemons import DaemonProcess, cli_json

TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "OMP_NUM_THREADS": "1",
}


def _training(d: DaemonProcess) -> dict[str, Any]:
    try:
        return d.call("status").get("training") or {}
    except (LatticaError, OSError):
        return {}


class Swarm:
    def __init__(self, root: Path, *, nodes: int, rounds: int, inner_steps: int, deadline_s: float) -> None:
        self.root, self.nodes, self.rounds = root, nodes, rounds
        args = (
            "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info",
            "--rounds", str(rounds), "--inner-steps", str(inner_steps), "--min-peers", str(nodes),
        )
        env = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": str(deadline_s)}
        self.daemons = [
            DaemonProcess(root / f"n{i}", extra_args=args, env=env) for i in range(nodes)
        ]
        self.addrs: dict[int, str] = {}

    def start(self) -> None:
        first = self.daemons[0].start()
        first.wait_ready(60)
        self.addrs[0] = first.addr
        for d in self.daemons[1:]:
            d.peers = (self.addrs[0],)
            d.start()
        for i, d in enumerate(self.daemons[1:], 1):
            d.wait_ready(60)
            self.addrs[i] = d.addr

    def restart(self, i: int) -> None:
        d = self.daemons[i]
        d.peers = tuple(a for j, a in self.addrs.items() if j != i)
        d.start()
        d.wait_ready(60)

    def progress(self) -> list[int]:
        return [int(_training(d).get("rounds_completed") or 0) for d in self.daemons]

    def done(self) -> bool:
        return all(_training(d).get("phase") == "done" for d in self.daemons)

    def stop(self) -> None:
        for d in self.daemons:
            d.kill()

    def final(self) -> tuple[float, bool, int]:
        """Mean last loss, whether every replica published the same hash at the last round, and
        the slowest replica's round. A daemon that does not answer counts as not identical."""
        infos = [_training(d) for d in self.daemons]
        losses = [float(i["loss"]) for i in infos if i.get("loss") is not None]
        hashes: set[str] = set()
        try:
            ids = [d.peer_id for d in self.daemons]
            for d in self.daemons:
                progress = cli_json("state", "--data-dir", str(d.data_dir))["progress"]
                for peer in ids:
                    record = progress.get(peer) or {}
                    hashes.add(record.get("weights_hash") if record.get("round") == self.rounds else "missing")
        except (LatticaError, RuntimeError) as exc:
            print(f"final check: a daemon did not answer: {exc}", flush=True)
            hashes.add("unanswered")
        identical = len(hashes) == 1 and not hashes & {"missing", "unanswered"}
        return sum(losses) / max(len(losses), 1), identical, min(self.progress())


def _wait_first_round(swarm: Swarm, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while max(swarm.progress()) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("no round completed")
        time.sleep(0.25)


def run_undisturbed(root: Path, args: argparse.Namespace) -> float:
    swarm = Swarm(root / "calm", nodes=args.nodes, rounds=args.rounds, inner_steps=args.inner_steps,
                  deadline_s=args.deadline_s)
    try:
        swarm.start()
        deadline = time.monotonic() + args.timeout_s
        while not swarm.done() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2.0)  # progress records spread
        return swarm.final()[0]
    finally:
        swarm.stop()


def run_chaos(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    swarm = Swarm(root / "chaos", nodes=args.nodes, rounds=args.rounds, inner_steps=args.inner_steps,
                  deadline_s=args.deadline_s)
    kills = partitions = lost = 0
    resuming: dict[int, int] = {}  # restarted peer -> rounds it had completed before the kill
    stall, last_max, last_advance = 0.0, 0, 0.0
    try:
        swarm.start()
        _wait_first_round(swarm, 120)
        last_advance = time.monotonic()
        next_event = time.monotonic() + args.kill_every
        deadline = time.monotonic() + args.timeout_s
        while not swarm.done() and time.monotonic() < deadline:
            now = time.monotonic()
            newest = max(swarm.progress())
            if newest > last_max:
                last_max, last_advance = newest, now
            elif newest < args.rounds:
                stall = max(stall, now - last_advance)
            for i, before in list(resuming.items()):
                info = _training(swarm.daemons[i])
                if info.get("phase") in ("training", "done"):
                    lost += max(0, before - int(info.get("rounds_completed") or 0))
                    del resuming[i]
            if now >= next_event and newest < args.rounds - 2:
                victim = rng.choice([i for i in range(args.nodes) if i not in resuming] or [0])
                d = swarm.daemons[victim]
                if (kills + partitions + 1) % args.partition_every == 0:
                    d.signal(signal.SIGSTOP)
                    time.sleep(args.partition_s)
                    d.signal(signal.SIGCONT)
                    partitions += 1
                else:
                    before = int(_training(d).get("rounds_completed") or 0)
                    d.kill()
                    kills += 1
                    swarm.restart(victim)
                    resuming[victim] = before  # checked below once it trains again
                next_event = time.monotonic() + args.kill_every
            time.sleep(0.25)
        print(f"chaos phase over: kills={kills} partitions={partitions} rounds={swarm.progress()} "
              f"done={swarm.done()}", flush=True)
        time.sleep(2.0)
        final_loss, identical, slowest = swarm.final()
        return {
            "kills": kills, "partitions": partitions, "rounds_completed": slowest,
            "lost_rounds": lost, "max_stall_s": round(stall, 2), "deadline_s": args.deadline_s,
            "final_loss": round(final_loss, 4), "replicas_identical": identical,
        }
    finally:
        swarm.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=5.0)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between disturbances")
    parser.add_argument("--partition-every", type=int, default=6, help="every n-th disturbance is a partition")
    parser.add_argument("--partition-s", type=float, default=3.0)
    parser.add_argument("--timeout-s", type=float, default=360.0, help="per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-undisturbed", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lattica-chaos-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        result = run_chaos(root, args)
        result["undisturbed_loss"] = None if args.skip_undisturbed else round(run_undisturbed(root, args), 4)
        if result["undisturbed_loss"]:
            result["loss_ratio"] = round(result["final_loss"] / result["undisturbed_loss"], 4)
        result["nodes"], result["rounds"], result["wall_s"] = args.nodes, args.rounds, round(time.monotonic() - started, 1)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
