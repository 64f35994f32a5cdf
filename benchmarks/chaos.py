"""Chaos: ``lattica join --train`` daemons in a namespace lab, under SIGKILL + restart and link cuts.

Every daemon runs in its own network namespace, a public host of a ``NetLab`` (198.18.0.x on one
"internet" bridge), so a partition is a real link cut: the host's port on the bridge goes down
(packets vanish both ways; no reset, no error on either side) and comes back up to heal.

Phase 1 (chaos): N daemons train DiLoCo (tiny model, short rounds) for R rounds. Every
``--kill-every`` seconds one disturbance hits a random peer that is neither restarting nor cut
off: SIGKILL and an immediate restart with the same data dir, identity and address (it resumes
from its checkpoint and rejoins), or — every ``--partition-every``-th disturbance — a link cut
for ``--partition-s`` seconds. At most ``--max-restarting`` peers are down and one is cut off
at a time, so the swarm is never all down. Disturbances stop ``--calm-rounds`` rounds before the end.
Phase 2 (undisturbed): the same run in a fresh lab, with no disturbance, the same peer
identities (so the same data shards and order).

Measured (from outside: the daemons' control sockets and ``lattica state``):

- ``kills``, ``partitions``: disturbances done; ``founder_kills``: kills of n0, the node that
  started the swarm (the first kill is always its: it restarts with ``--peer`` like the others).
- ``rounds_reached``: the round every replica reached at the end (the slowest one's): its
  inner step over the inner steps per round, whether it ran the round, adopted the swarm's
  state of it or skipped it (``rounds_completed`` of ``lattica status`` counts only rounds
  whose outer step it applied: a failed sync leaves it behind for good).
- ``lost_rounds``: per kill, the round the victim had reached just before the SIGKILL minus
  the round it reports once it trains again, when less; summed.
- ``max_stall_s``: the longest time, after the first round, in which the swarm's newest round
  (the most any live replica reports) did not advance; polled every 0.25 s.
- ``final_loss`` / ``undisturbed_loss``: validation loss of the final model (the mean over the
  replicas; identical replicas give identical values), and their ratio ``loss_ratio``.
- ``replicas_identical``: every replica's published record is at round R with one hash.
- ``contributions`` / ``undisturbed_contributions``: the members whose pseudo-gradients each
  round averaged, summed over the rounds (read from the daemons' ``sync round/N done with K
  member(s)`` log lines), and ``contributions_ratio``: how much of the undisturbed run's data the
  disturbed run trained on — a killed member misses every round until it trains again, so the
  loss ratio is to be read beside it.
- ``restart_to_contribution_s``: the median, over the kills, of the seconds from the SIGKILL to
  the victim's first round averaged with others (``sync round/N done with K member(s)``, K ≥ 2,
  in its log) — a kill whose victim was killed again before that is left out; ``restarts_measured``
  how many kills the median is of.

By default the daemons share the machine's cores freely: while some restart, the others train
faster and run more rounds without them (a 6-member round took ~0.6 s, a 3-member one ~0.2 s on
2 cores), so ``contributions_ratio`` was ~0.64 in the runs on record. ``--cpu-share C`` gives
each daemon a fixed quota of C CPUs (a cgroup v1 ``cpu`` group per node), as a node on its own
machine would have; measured with 2/6 CPU each it changed little (restarts are slower under the
quota): contributions 0.61, loss ratio 1.070, a longest stall of 11.2 s.

Needs root (network namespaces; cgroups with ``--cpu-share``). Last line: one JSON object.

A phase that does not finish — a replica not done within ``--timeout-s`` or without a validation
loss, no first round — fails the benchmark: exit status 1 and one line on stderr naming the
phase and the replicas, no figures (never a loss of 0 or null standing in for one). So does,
at once, a replica that stops progressing: up (neither restarting nor cut off) and not done,
its round unchanged for ``--stuck-s`` while the swarm's newest round moved on, or still not
training ``--stuck-s`` after a restart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica.errors import LatticaError
from lattica_lab.daemons import DaemonProcess, cli_json
from lattica_lab.netlab import LabHost, NetLab

TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "OMP_NUM_THREADS": "1",
}
PORT = 4001
POLL_S = 0.25


class PhaseUnfinished(RuntimeError):
    """A phase of the benchmark did not finish: it has no figures to report."""


def finished_loss(phase: str, infos: list[dict[str, Any]]) -> float:
    """The mean validation loss of a phase in which every replica finished; else raises
    ``PhaseUnfinished`` naming the replicas that did not (with their phase and round)."""
    if not infos:
        raise PhaseUnfinished(f"{phase} phase: no replica answered")
    late = [
        f"n{i} ({info.get('phase') or 'no answer'}, round {int(info.get('round') or 0)})"
        for i, info in enumerate(infos)
        if info.get("phase") != "done" or not _finite(info.get("val_loss"))
    ]
    if late:
        raise PhaseUnfinished(f"{phase} phase did not finish: {', '.join(late)}")
    return sum(float(info["val_loss"]) for info in infos) / len(infos)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _training(d: DaemonProcess) -> dict[str, Any]:
    try:
        return d.call("status").get("training") or {}
    except (LatticaError, OSError):
        return {}


class CpuCaps:
    """A fixed CPU share per daemon: one cgroup (v1 ``cpu`` controller) per node with a CFS quota
    of ``share`` CPUs; a started daemon's process is moved into its node's group, and its
    children (none here) would follow it."""

    ROOT = Path("/sys/fs/cgroup/cpu")
    PERIOD_US = 100_000

    def __init__(self, share: float, nodes: int, phase: str) -> None:
        self.dir = self.ROOT / f"lattica-chaos-{os.getpid()}-{phase}"
        self.groups = [self.dir / f"n{i}" for i in range(nodes)]
        for group in self.groups:
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * self.PERIOD_US))))

    def place(self, node: int, pid: int) -> None:
        (self.groups[node] / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for group in [*self.groups, self.dir]:
            with contextlib.suppress(OSError):  # a process not reaped yet: the group stays behind
                group.rmdir()


class Swarm:
    """N daemons, one per lab host; the first is everyone's bootstrap peer."""

    def __init__(self, lab: NetLab, root: Path, args: argparse.Namespace, caps: CpuCaps | None = None) -> None:
        self.caps = caps
        self.lab, self.rounds, self.deadline_s, self.inner_steps = lab, args.rounds, args.deadline_s, args.inner_steps
        train = (
            "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info",
            "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
            "--min-peers", str(args.nodes),
        )
        env = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": str(args.deadline_s)}
        self.hosts: list[LabHost] = [lab.add_public(f"n{i}") for i in range(args.nodes)]
        self.daemons = [
            DaemonProcess(root / f"n{i}", port=PORT, extra_args=train, env=env, netns=h.ns, listen_ip=h.ip)
            for i, h in enumerate(self.hosts)
        ]
        self.addrs: list[str] = []

    def _started(self, i: int) -> DaemonProcess:
        d = self.daemons[i].start()
        if self.caps is not None and d.proc is not None:
            self.caps.place(i, d.proc.pid)
        return d

    def start(self) -> None:
        first = self._started(0)
        first.wait_ready(120)
        bootstrap = first.addr
        for i, d in enumerate(self.daemons[1:], start=1):
            d.peers = (bootstrap,)
            self._started(i)
        for d in self.daemons[1:]:
            d.wait_ready(120)
        self.addrs = [d.addr for d in self.daemons]
        for i, d in enumerate(self.daemons):
            _say(f"n{i} is {d.peer_id} at {self.hosts[i].ip}")

    def restart(self, i: int) -> None:
        """SIGKILL daemon ``i`` and start it again at once (same data dir, address, identity)."""
        d = self.daemons[i]
        d.kill()
        d.peers = tuple(a for j, a in enumerate(self.addrs) if j != i)
        self._started(i)

    def infos(self) -> list[dict[str, Any]]:
        return [_training(d) for d in self.daemons]

    def stop(self) -> None:
        for d in self.daemons:
            d.kill()


def _reached(info: dict[str, Any], inner_steps: int) -> int:
    """The round a replica reached (see ``rounds_reached`` in the docstring); 0 before its
    first progress report."""
    return int(info.get("step") or 0) // inner_steps


def _published(swarm: Swarm) -> set[str]:
    """What the replicas' records at the last round say, as every daemon sees them."""
    hashes: set[str] = set()
    try:
        ids = [d.peer_id for d in swarm.daemons]
        for d in swarm.daemons:
            progress = cli_json("state", "--data-dir", str(d.data_dir))["progress"]
            for peer in ids:
                record = progress.get(peer) or {}
                hashes.add(record.get("weights_hash") if record.get("round") == swarm.rounds else "missing")
    except (LatticaError, RuntimeError) as exc:
        print(f"final check: a daemon did not answer: {exc}", flush=True)
        hashes.add("unanswered")
    return hashes


def _final(swarm: Swarm, timeout: float, phase: str) -> tuple[float, bool, int]:
    """Wait (up to ``timeout``) until every replica is done and all published the same state
    at the last round; the mean validation loss, whether they agree, the slowest round.
    Raises ``PhaseUnfinished`` when a replica is not done by then."""
    deadline = time.monotonic() + timeout
    while True:
        infos = swarm.infos()
        done = all(i.get("phase") == "done" for i in infos)
        hashes = _published(swarm) if done else {"training"}
        identical = len(hashes) == 1 and not hashes & {"missing", "unanswered", "training"}
        if identical or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return finished_loss(phase, infos), identical, min(_reached(i, swarm.inner_steps) for i in infos)


@dataclass
class _Chaos:
    kills: int = 0
    founder_kills: int = 0
    partitions: int = 0
    lost: int = 0
    stall: float = 0.0
    newest: int = 0
    last_advance: float = 0.0
    cut: tuple[int, float] | None = None  # peer, heal time
    # restarted peer -> (round before the kill, when)
    resuming: dict[int, tuple[int, float]] = field(default_factory=dict)
    unmeasured: dict[int, int] = field(default_factory=dict)  # trains again, no progress yet -> round before
    # peer -> (round, since, swarm's newest then)
    progress: dict[int, tuple[int, float, int]] = field(default_factory=dict)
    killed_at: list[tuple[int, float]] = field(default_factory=list)  # (peer, wall clock of the SIGKILL)

    def watch(self, swarm: Swarm, infos: list[dict[str, Any]], now: float, stuck_s: float) -> None:
        newest = max(_reached(i, swarm.inner_steps) for i in infos)
        if newest > self.newest:
            if now - self.last_advance > swarm.deadline_s:
                _say(f"stall of {now - self.last_advance:.1f} s before round {newest}")
            self.newest, self.last_advance = newest, now
        elif newest < swarm.rounds:
            self.stall = max(self.stall, now - self.last_advance)
        for i, (before, _) in list(self.resuming.items()):
            if infos[i].get("phase") in ("training", "done"):
                self.unmeasured[i] = before
                del self.resuming[i]
        for i, before in list(self.unmeasured.items()):
            if "step" in infos[i]:  # its first progress report since the restart
                self.lost += max(0, before - _reached(infos[i], swarm.inner_steps))
                del self.unmeasured[i]
        self._check_progress(infos, now, stuck_s, swarm.inner_steps)

    def _check_progress(self, infos: list[dict[str, Any]], now: float, stuck_s: float, inner_steps: int) -> None:
        """Raise ``PhaseUnfinished`` naming a replica that stopped progressing (see the docstring)."""
        for i, info in enumerate(infos):
            if i in self.resuming:
                before, since = self.resuming[i]
                if now - since > stuck_s:
                    raise PhaseUnfinished(
                        f"chaos phase: n{i} is not training {now - since:.0f} s after its restart "
                        f"(phase {info.get('phase') or 'no answer'}, round {_reached(info, inner_steps)}, "
                        f"round {before} before the kill; the swarm is at round {self.newest})"
                    )
                self.progress.pop(i, None)  # watched afresh once it trains again
                continue
            reached = _reached(info, inner_steps)
            last = self.progress.get(i)
            if last is None or reached != last[0] or (self.cut is not None and self.cut[0] == i):
                self.progress[i] = (reached, now, self.newest)
                continue
            if info.get("phase") != "done" and now - last[1] > stuck_s and self.newest > last[2]:
                raise PhaseUnfinished(
                    f"chaos phase: n{i} stopped progressing: at round {reached} (phase "
                    f"{info.get('phase') or 'no answer'}) for {now - last[1]:.0f} s while the swarm went "
                    f"from round {last[2]} to {self.newest}"
                )

    def disturb(self, swarm: Swarm, rng: random.Random, infos: list[dict[str, Any]], args: argparse.Namespace) -> None:
        busy = set(self.resuming) | ({self.cut[0]} if self.cut else set())
        victims = [i for i in range(len(swarm.daemons)) if i not in busy]
        partition = (self.kills + self.partitions + 1) % args.partition_every == 0
        if partition and self.cut is None and victims:
            victim = rng.choice(victims)
            _say(f"cut n{victim} (round {self.newest})")
            swarm.lab.cut_link(swarm.hosts[victim])
            self.cut = (victim, time.monotonic() + args.partition_s)
            self.partitions += 1
        elif len(self.resuming) < args.max_restarting and victims:
            # the founder (n0: no --peer at its first start, the run config's admin) is the
            # first victim, so every run restarts it at least once; then anyone
            victim = 0 if self.founder_kills == 0 and 0 in victims else rng.choice(victims)
            self.founder_kills += victim == 0
            _say(f"kill n{victim} (round {self.newest})")
            before = _reached(_training(swarm.daemons[victim]), swarm.inner_steps)
            self.resuming[victim] = (before, time.monotonic())
            self.killed_at.append((victim, time.time()))
            swarm.restart(victim)
            self.kills += 1

    def heal_due(self, swarm: Swarm, now: float) -> None:
        if self.cut is not None and now >= self.cut[1]:
            _say(f"heal n{self.cut[0]}")
            swarm.lab.heal_link(swarm.hosts[self.cut[0]])
            self.cut = None


_STARTED = time.monotonic()
_SYNC_DONE = re.compile(r"sync round/(\d+) done with (\d+) member")


def contributions(phase_dir: Path) -> int:
    """Members averaged per round, summed over the rounds any daemon of ``phase_dir`` logged."""
    members: dict[int, int] = {}
    for log in phase_dir.glob("n*/daemon.log"):
        for match in _SYNC_DONE.finditer(log.read_text(errors="replace")):
            rnd, k = int(match[1]), int(match[2])
            members[rnd] = max(members.get(rnd, 0), k)
    return sum(members.values())


_LOGGED_SYNC = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) .*sync round/\d+ done with (\d+) member", re.M)


def _seconds_of_day(wall: float) -> float:
    t = time.localtime(wall)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + wall % 1


def restart_to_contribution(phase_dir: Path, killed_at: list[tuple[int, float]]) -> list[float]:
    """Per kill, the seconds from the SIGKILL to the victim's first round averaged with others
    after it (its daemon log's clock, the local time of day as the benchmark's); a kill whose
    victim was killed again first has none."""
    synced: dict[int, list[float]] = {}
    for peer in {peer for peer, _ in killed_at}:
        log = (phase_dir / f"n{peer}" / "daemon.log").read_text(errors="replace")
        synced[peer] = [
            int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
            for m in _LOGGED_SYNC.finditer(log) if int(m[4]) >= 2
        ] if log else []
    seconds = []
    for index, (peer, wall) in enumerate(killed_at):
        killed = _seconds_of_day(wall)
        next_kill = min((w for p, w in killed_at[index + 1:] if p == peer), default=math.inf)
        after = [(t - killed) % 86400 for t in synced[peer]]  # across midnight too
        first = min((s for s in after if s < 43200), default=math.inf)
        if wall + first < next_kill:
            seconds.append(first)
    return seconds


def _say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} +{time.monotonic() - _STARTED:6.1f}s {line}", flush=True)


def _wait_first_round(swarm: Swarm, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while max(_reached(i, swarm.inner_steps) for i in swarm.infos()) < 1:
        if time.monotonic() > deadline:
            raise PhaseUnfinished(f"chaos phase: no round completed in {timeout:.0f} s")
        time.sleep(POLL_S)


def _caps(args: argparse.Namespace, phase: str) -> CpuCaps | None:
    return CpuCaps(args.cpu_share, args.nodes, phase) if args.cpu_share > 0 else None


def run_chaos(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    chaos = _Chaos()
    with NetLab() as lab:
        caps = _caps(args, "chaos")
        swarm = Swarm(lab, root / "chaos", args, caps)
        try:
            swarm.start()
            _wait_first_round(swarm, 180)
            chaos.newest, chaos.last_advance = 1, time.monotonic()
            next_event = time.monotonic() + args.kill_every
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline:
                now = time.monotonic()
                infos = swarm.infos()
                if all(i.get("phase") == "done" for i in infos):
                    break
                chaos.watch(swarm, infos, now, args.stuck_s)
                chaos.heal_due(swarm, now)
                if now >= next_event and chaos.newest < args.rounds - args.calm_rounds:
                    chaos.disturb(swarm, rng, infos, args)
                    next_event = now + args.kill_every
                time.sleep(POLL_S)
            if chaos.cut is not None:
                swarm.lab.heal_link(swarm.hosts[chaos.cut[0]])
            print(f"chaos phase over: kills={chaos.kills} partitions={chaos.partitions} "
                  f"rounds={[_reached(i, swarm.inner_steps) for i in swarm.infos()]}", flush=True)
            final_loss, identical, slowest = _final(swarm, 60, "chaos")
            return {
                "kills": chaos.kills, "founder_kills": chaos.founder_kills, "partitions": chaos.partitions,
                "rounds_reached": slowest,
                "lost_rounds": chaos.lost, "max_stall_s": round(chaos.stall, 2),
                "deadline_s": args.deadline_s, "final_loss": round(final_loss, 4),
                "replicas_identical": identical, "contributions": contributions(root / "chaos"),
                **_restart_figures(restart_to_contribution(root / "chaos", chaos.killed_at)),
            }
        finally:
            swarm.stop()
            if caps is not None:
                caps.close()


def _restart_figures(seconds: list[float]) -> dict[str, Any]:
    median = round(statistics.median(seconds), 2) if seconds else None
    return {"restart_to_contribution_s": median, "restarts_measured": len(seconds)}


def run_undisturbed(root: Path, args: argparse.Namespace) -> float:
    # the chaos phase's identities: a peer's data order follows from its peer id, so the two
    # phases train on the same shards in the same order and differ only by the disturbances
    # (with fresh identities the undisturbed loss alone varied by 4 % from run to run)
    for i in range(args.nodes):
        key = root / "chaos" / f"n{i}" / "identity.key"
        if key.is_file():
            (root / "calm" / f"n{i}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(key, root / "calm" / f"n{i}" / "identity.key")
    with NetLab() as lab:
        caps = _caps(args, "calm")
        swarm = Swarm(lab, root / "calm", args, caps)
        try:
            swarm.start()
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline and not all(i.get("phase") == "done" for i in swarm.infos()):
                time.sleep(0.5)
            return _final(swarm, 30, "undisturbed")[0]
        finally:
            swarm.stop()
            if caps is not None:
                caps.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=5.0)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between disturbances")
    parser.add_argument("--partition-every", type=int, default=5, help="every n-th disturbance is a link cut")
    parser.add_argument("--partition-s", type=float, default=8.0)
    parser.add_argument("--max-restarting", type=int, default=2, help="peers restarting at once, at most")
    parser.add_argument("--calm-rounds", type=int, default=3, help="no disturbance in the last rounds")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per phase")
    parser.add_argument("--stuck-s", type=float, default=60.0,
                        help="fail when a replica's round stays put this long while the swarm moves on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-share", type=float, default=0.0,
                        help="a fixed CPU quota per daemon, in CPUs (default 0: the cores shared freely)")
    parser.add_argument("--skip-undisturbed", action="store_true")
    parser.add_argument("--keep-dir", type=Path, default=None, help="keep data dirs and logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lattica-chaos-") as tmp:
        root = args.keep_dir or Path(tmp)
        started = time.monotonic()
        try:
            result = run_chaos(root, args)
            if not args.skip_undisturbed:
                result["undisturbed_loss"] = round(run_undisturbed(root, args), 4)
                result["loss_ratio"] = round(result["final_loss"] / result["undisturbed_loss"], 4)
                result["undisturbed_contributions"] = contributions(root / "calm")
                result["contributions_ratio"] = round(
                    result["contributions"] / max(result["undisturbed_contributions"], 1), 4
                )
        except PhaseUnfinished as exc:
            print(f"chaos benchmark failed: {exc}", file=sys.stderr)
            sys.exit(1)
        result["nodes"], result["rounds"] = args.nodes, args.rounds
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["cpu_share"] = args.cpu_share
        print(json.dumps(result))


if __name__ == "__main__":
    main()
