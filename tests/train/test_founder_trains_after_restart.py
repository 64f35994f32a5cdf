"""The trainer that started the swarm goes down and comes back: it trains on with the others.

Two ``lattica join --train`` processes on loopback (tiny model, DiLoCo): the founder ``a`` (no
``--peer``; the run config's admin) and ``b``, which joined through it.

- Killed (SIGKILL) and restarted with ``--peer b``, the founder is still the run's admin: its
  own state log's run config and the copies its peers send are accepted (before, both were
  refused as "unauthorized", every sync with a peer was dropped, and it waited at round 0
  while the other finished).
- Stopped (``lattica stop``) and started again with its first command (no ``--peer``), it
  reconnects to the member it knew and takes part in the rounds again (before, it dialed
  nobody and sealed rounds alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    log_from,
    sync_members,
    train_args,
    training,
    wait_done,
)

ROUNDS = 30
INNER_STEPS = 40  # ~0.5 s a round here: most rounds are still to come when the founder is back
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "3"}


def _trainer(path: Path, *, port: int | None = None, peers: tuple[str, ...] = ()) -> DaemonProcess:
    args = train_args("diloco", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=2)
    if port is None:
        return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)
    return DaemonProcess(path, port=port, peers=peers, extra_args=args, env=ENV)


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    daemons: list[DaemonProcess] = []
    try:
        yield daemons
    finally:
        for daemon in daemons:
            daemon.kill()


def _founder_and_joiner(tmp_path: Path, started: list[DaemonProcess]) -> tuple[DaemonProcess, DaemonProcess]:
    a = _trainer(tmp_path / "a").start()
    started.append(a)
    a.wait_ready(60)
    b = _trainer(tmp_path / "b", peers=(a.addr,)).start()
    started.append(b)
    b.wait_ready(60)
    assert wait_for(lambda: all(training(d).get("round", 0) >= 2 for d in (a, b)), 120), (a.log(), b.log())
    return a, b


def test_a_killed_founder_restarted_with_peer_is_still_the_admin(tmp_path: Path, started: list[DaemonProcess]) -> None:
    a, b = _founder_and_joiner(tmp_path, started)
    offset = len(a.log_path.read_text())
    a.kill()
    again = _trainer(tmp_path / "a", port=a.port, peers=(b.addr,)).start()
    started.append(again)
    again.wait_ready(60)
    infos = wait_done([again, b], timeout=180)
    assert [i["round"] for i in infos] == [ROUNDS, ROUNDS]
    assert len(final_hashes([again, b], rounds=ROUNDS)) == 1
    for log in (log_from(again, offset), b.log()):
        assert "unauthorized" not in log, log[-6000:]
        assert "dropping bad input" not in log, log[-6000:]
    assert sync_members(log_from(again, offset)).count(2) >= 3  # it trained with b again


def test_a_stopped_founder_started_again_rejoins_the_rounds(tmp_path: Path, started: list[DaemonProcess]) -> None:
    a, b = _founder_and_joiner(tmp_path, started)
    offset = len(a.log_path.read_text())
    assert run_cli("stop", "--data-dir", str(a.data_dir)).returncode == 0
    assert a.proc is not None
    assert a.proc.wait(timeout=10) == 0
    again = _trainer(tmp_path / "a", port=a.port).start()  # the same command: no --peer
    started.append(again)
    again.wait_ready(60)
    infos = wait_done([again, b], timeout=180)
    assert [i["round"] for i in infos] == [ROUNDS, ROUNDS]
    assert len(final_hashes([again, b], rounds=ROUNDS)) == 1
    # back one round behind (b ran on while it restarted), it may seal a round or two alone
    # before it catches up, as any restarted trainer; then it trains with b
    syncs = sync_members(log_from(again, offset))
    assert syncs.count(2) >= 3, log_from(again, offset)[-6000:]
    assert syncs.count(2) > syncs.count(1), log_from(again, offset)[-6000:]
