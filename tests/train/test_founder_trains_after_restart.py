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

Both restarts happen in one run, one after the other: each needs the founder, a joiner that
trained with it, and rounds still to come.
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

# ~0.5 s a round here (~1.5 s on a loaded machine), and the joiner runs on alone while the founder
# restarts (seconds: it imports torch): ~12 rounds a restart under load, two restarts in the run
ROUNDS = 50
INNER_STEPS = 40
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


def _restarted(again: DaemonProcess, started: list[DaemonProcess]) -> DaemonProcess:
    started.append(again.start())
    again.wait_ready(60)
    return again


def _clean(log: str) -> None:
    assert "unauthorized" not in log, log[-6000:]
    assert "dropping bad input" not in log, log[-6000:]


def test_a_killed_then_stopped_founder_trains_on_with_the_joiner(tmp_path: Path, started: list[DaemonProcess]) -> None:
    """Both restarts in one run (each needs the founder, a joiner and rounds to come): killed
    and restarted with ``--peer b``, then stopped and started again with its first command."""
    a, b = _founder_and_joiner(tmp_path, started)
    killed_at = len(a.log_path.read_text())
    a.kill()
    again = _restarted(_trainer(tmp_path / "a", port=a.port, peers=(b.addr,)), started)
    # still the admin: it trains with b again (three syncs of two, well before the run ends)
    assert wait_for(lambda: sync_members(log_from(again, killed_at)).count(2) >= 3, 120), (
        log_from(again, killed_at)[-6000:]
    )
    _clean(log_from(again, killed_at))

    stopped_at = len(a.log_path.read_text())
    assert run_cli("stop", "--data-dir", str(a.data_dir)).returncode == 0
    assert again.proc is not None
    assert again.proc.wait(timeout=10) == 0
    back = _restarted(_trainer(tmp_path / "a", port=a.port), started)  # the first command: no --peer
    infos = wait_done([back, b], timeout=180)
    assert [i["round"] for i in infos] == [ROUNDS, ROUNDS]
    assert len(final_hashes([back, b], rounds=ROUNDS)) == 1
    for log in (log_from(back, killed_at), b.log()):
        _clean(log)
    # back one round behind (b ran on while it restarted), it may seal a round or two alone
    # before it catches up, as any restarted trainer; then it trains with b
    syncs = sync_members(log_from(back, stopped_at))
    assert syncs.count(2) >= 3, log_from(back, stopped_at)[-6000:]
    assert syncs.count(2) > syncs.count(1), log_from(back, stopped_at)[-6000:]
