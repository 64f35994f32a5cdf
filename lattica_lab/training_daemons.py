"""Real ``lattica join --train`` daemons for the training tests: a small trainer's settings, its
status, its syncs as logged, the end of its run and the hashes every replica published.

Each test starts its own daemons (tiny model, batch 4, a few inner steps) on loopback and reads
the outcome the way a user would: over the control socket, ``lattica state --json`` and the log.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lattica_lab.daemons import DaemonProcess, wait_for

TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "OMP_NUM_THREADS": "1",  # several daemons share the cores
}
# gossip tests: a partner is waited for 3 s, a silent member 5 s
GOSSIP_ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "5", "LATTICA_TRAIN_GROUP_GRACE_S": "3.0"}
SYNC = re.compile(r"sync round/(\d+) done with (\d+) member")


def train_args(strategy: str, *, rounds: int, inner_steps: int, min_peers: int) -> tuple[str, ...]:
    """``join`` flags of a small trainer on the CPU that logs every sync."""
    return (
        "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info", "--strategy", strategy,
        "--rounds", str(rounds), "--inner-steps", str(inner_steps), "--min-peers", str(min_peers),
    )


def start_gossip_trainers(
    base: Path, started: list[DaemonProcess], count: int, strategy: str, *, rounds: int, inner_steps: int,
    extra: tuple[str, ...] = (),
) -> list[DaemonProcess]:
    """``count`` trainers averaging by gossip (``--averaging gossip`` and ``extra``) in
    ``base/p0``…: the first starts a swarm, the others join it from its address; each is added
    to ``started`` (``killed_at_end``) and is ready when this returns."""

    def trainer(i: int, peers: tuple[str, ...]) -> DaemonProcess:
        args = (*train_args(strategy, rounds=rounds, inner_steps=inner_steps, min_peers=count),
                "--averaging", "gossip", *extra)
        daemon = DaemonProcess(base / f"p{i}", peers=peers, extra_args=args, env=GOSSIP_ENV).start()
        started.append(daemon)
        return daemon

    first = trainer(0, ())
    first.wait_ready(60)
    others = [trainer(i, (first.addr,)) for i in range(1, count)]
    for d in others:
        d.wait_ready(60)
    return [first, *others]


@contextmanager
def killed_at_end() -> Iterator[list[DaemonProcess]]:
    """A list the test adds its daemons to; each is resumed (if stopped) and killed at the end."""
    started: list[DaemonProcess] = []
    try:
        yield started
    finally:
        for d in started:
            d.signal(signal.SIGCONT)
            d.kill()


def training(daemon: DaemonProcess) -> dict[str, Any]:
    # the control socket answers before the daemon's services (training among them) start
    return daemon.call("status").get("training") or {"phase": "starting", "rounds_completed": 0}


def rounds_completed(daemon: DaemonProcess) -> int:
    return int(training(daemon).get("rounds_completed") or 0)


def log_from(daemon: DaemonProcess, offset: int = 0) -> str:
    """The daemon log from ``offset`` on (a restarted daemon appends to it)."""
    return daemon.log_path.read_text()[offset:]


def sync_members(log: str) -> list[int]:
    """The number of members of each completed sync, in order."""
    return [int(m.group(2)) for m in SYNC.finditer(log)]


def paired_syncs(daemon: DaemonProcess, offset: int = 0) -> int:
    """Syncs with a partner (two members or more) logged from ``offset`` on."""
    return sum(1 for members in sync_members(log_from(daemon, offset)) if members >= 2)


def wait_done(daemons: list[DaemonProcess], timeout: float) -> list[dict[str, Any]]:
    """Every daemon's training status once all are done; fails at once when one failed."""

    def all_done() -> list[dict[str, Any]] | None:
        infos = [training(d) for d in daemons]
        for d, info in zip(daemons, infos, strict=True):
            assert info["phase"] != "failed", (info, d.log())
        return infos if all(i["phase"] == "done" for i in infos) else None

    infos = wait_for(all_done, timeout)
    assert infos, "\n\n".join(f"{training(d)}\n{d.log()}" for d in daemons)
    return infos


def final_hashes(daemons: list[DaemonProcess], rounds: int, timeout: float = 20.0) -> set[str]:
    """Each node's view of every node's hash at ``rounds``: the replicated state as ``lattica
    state --json`` prints it, read over the control socket (what that command asks a running
    node; a process start per read cost seconds a poll)."""
    ids = [d.peer_id for d in daemons]

    def converged() -> set[str] | None:
        seen: set[str] = set()
        for d in daemons:
            progress = d.call("state")["progress"]
            for peer in ids:
                record = progress.get(peer) or {}
                if record.get("round") != rounds:
                    return None
                seen.add(record["weights_hash"])
        return seen

    hashes = wait_for(converged, timeout=timeout, interval=0.5)
    assert hashes, [d.call("state")["progress"] for d in daemons]
    return hashes
