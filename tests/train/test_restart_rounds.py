"""Two trainers a round apart after a restart must end up in the same rounds again.

Real ``lattica join --train`` daemons on loopback. The survivor of a kill runs rounds alone
while the others are down; when the restarted peer resumes from its checkpoint at the round the
survivor last published, the two are a round apart. Each then reached every round after the
other had sealed it and ran it alone, and neither adopted the other's state (rounds run alone
were never published): they stayed a round apart for the rest of the run.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, cli_json, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    killed_at_end,
    log_from,
    sync_members,
    train_args,
    training,
)

INNER_STEPS = 5
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "3"}


def _trainer(path: Path, *, rounds: int, peers: tuple[str, ...] = (), min_peers: int = 3) -> DaemonProcess:
    args = train_args("diloco", rounds=rounds, inner_steps=INNER_STEPS, min_peers=min_peers)
    return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def test_a_restarted_peer_a_round_behind_syncs_with_the_survivor_again(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    rounds = 24  # b is back and in step with a within a few rounds of its restart
    a = _trainer(tmp_path / "a", rounds=rounds).start()
    daemons.append(a)
    a.wait_ready(60)
    b, c = (_trainer(tmp_path / n, rounds=rounds, peers=(a.addr,)).start() for n in ("b", "c"))
    daemons.extend([b, c])
    for d in (b, c):
        d.wait_ready(60)
    assert wait_for(lambda: all(training(d)["rounds_completed"] >= 1 for d in (a, b, c)), 90), a.log()
    # c freezes: its connections stay up, so the others take it for a trainer whose link was
    # cut, and the rounds a runs alone from now on stay its own (not published) — as they do
    # while the lease of a killed peer runs out, only here for longer than b takes to restart
    c.signal(signal.SIGSTOP)
    b.kill()
    survivor_at = training(a)["rounds_completed"]
    assert wait_for(lambda: training(a)["rounds_completed"] > survivor_at, 30), a.log()  # a round alone
    assert b.log_path is not None
    restart = len(b.log_path.read_text())
    b.start().wait_ready(60)
    # within a few rounds of its restart b syncs with a again, and keeps doing so
    together = wait_for(lambda: 2 in sync_members(log_from(b, restart)), 60)
    syncs = sync_members(log_from(b, restart))
    assert together, (syncs, b.log(), a.log())
    assert syncs.index(2) <= 3, syncs
    assert wait_for(lambda: sync_members(log_from(b, restart)).count(2) >= 3, 45), (
        sync_members(log_from(b, restart)), b.log(),
    )
    # and they end on one state
    assert wait_for(lambda: all(training(d)["phase"] == "done" for d in (a, b)), 120), (a.log(), b.log())

    def final_hashes() -> set[str] | None:
        progress = a.call("state")["progress"]  # what `lattica state` prints, without a process start a poll
        records = [progress.get(d.peer_id) or {} for d in (a, b)]
        if any(r.get("round") != rounds for r in records):
            return None
        return {r["weights_hash"] for r in records}

    hashes = wait_for(final_hashes, 15, interval=0.5)
    assert hashes, cli_json("state", "--data-dir", str(a.data_dir))["progress"]
    assert len(hashes) == 1, hashes


def test_a_peer_restarted_after_the_run_ended_takes_the_final_state(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    # b comes back with fewer live trainers than --min-peers: it first checks that the state
    # published is served (a probe of its manifest), then fetches it. The holder refused the
    # manifest asked for twice within seconds, so b trained the whole run again alone from its
    # old checkpoint, and its state could then replace the run's.
    rounds = 4
    a = _trainer(tmp_path / "a", rounds=rounds, min_peers=2).start()
    daemons.append(a)
    a.wait_ready(60)
    b = _trainer(tmp_path / "b", rounds=rounds, min_peers=2, peers=(a.addr,)).start()
    daemons.append(b)
    b.wait_ready(60)
    assert wait_for(lambda: all(training(d)["rounds_completed"] >= 1 for d in (a, b)), 90), a.log()
    b.kill()
    assert wait_for(lambda: training(a)["phase"] == "done", 90), a.log()
    assert a.log_path is not None
    assert b.log_path is not None
    a_done, restart = len(a.log_path.read_text()), len(b.log_path.read_text())
    b.start().wait_ready(60)
    assert wait_for(lambda: training(b)["phase"] == "done", 90), b.log()
    log = log_from(b, restart)
    assert f"adopted outer state of round {rounds}" in log, log
    assert "could not fetch" not in log, log
    assert sync_members(log) == [], log  # no round trained again
    assert "adopted" not in log_from(a, a_done), a.log()
