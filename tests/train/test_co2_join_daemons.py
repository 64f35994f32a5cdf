"""CO2 under changing membership, across real ``lattica join --train`` processes on loopback.

CO2 applies each round's mean one round late: a member's outer state after a sync has the
all-reduce of the round before still in flight. A member that joins a running CO2 swarm adopts
the state a holder published and must end the run on the same line as the holders — every
round's mean applied once, the same final hash, every round counted — as a DiLoCo joiner does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    killed_at_end,
    rounds_completed,
    train_args,
    wait_done,
)

INNER_STEPS = 10
ROUNDS = 40  # long enough a run that the late members join with rounds to go


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as daemons:
        yield daemons


def _start(path: Path, started: list[DaemonProcess], *, min_peers: int) -> DaemonProcess:
    args = train_args("co2", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=min_peers)
    peers = (started[0].addr,) if started else ()
    daemon = DaemonProcess(path, peers=peers, extra_args=args, env=TRAIN_ENV).start()
    started.append(daemon)
    return daemon


@pytest.mark.parametrize("joiners", [1, 2])
def test_members_joining_a_running_co2_swarm_end_on_its_line(
    tmp_path: Path, started: list[DaemonProcess], joiners: int,
) -> None:
    first = []
    for name in ("a", "b"):  # the second joins the first's address
        first.append(_start(tmp_path / name, started, min_peers=2))
        first[-1].wait_ready(timeout=60)
    assert wait_for(lambda: all(rounds_completed(d) >= 2 for d in first), 60), [d.log() for d in first]
    late = [_start(tmp_path / f"j{i}", started, min_peers=1) for i in range(joiners)]
    for daemon in late:
        daemon.wait_ready(timeout=60)
    wait_done(started, timeout=120)
    for daemon in late:  # joined mid-run
        adopted = re.search(r"adopted outer state of round (\d+)", daemon.log())
        assert adopted, daemon.log()
        assert int(adopted.group(1)) < ROUNDS - 5, daemon.log()
    # a member whose last sync had no mean to land (it adopted a state just before) takes the
    # final state once the others publish it, as a DiLoCo member whose last round failed does
    assert len(final_hashes(started, ROUNDS)) == 1
    assert [rounds_completed(d) for d in started] == [ROUNDS] * len(started), [d.log()[-3000:] for d in started]
