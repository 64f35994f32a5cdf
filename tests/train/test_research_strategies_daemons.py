"""DES-LOC and CO2 across real ``lattica join --train`` processes on loopback.

Three daemons (tiny model, 5 inner steps, batch 4) train a few rounds over the real data plane.
Under all-reduce both keep bit-identical outer state on every member of a completed round —
DES-LOC the last means of the parameters and moments, CO2 its shared outer weights and momentum
— which the published outer-state hashes show.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    killed_at_end,
    train_args,
    wait_done,
)

INNER_STEPS = 5


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as daemons:
        yield daemons


# DES-LOC over 6 rounds: round 3 averages the first moment too, round 6 both moments
@pytest.mark.parametrize(("strategy", "rounds"), [("desloc", 6), ("co2", 3)])
def test_three_daemons_stay_bit_identical(tmp_path: Path, started: list[DaemonProcess], strategy: str,
                                          rounds: int) -> None:
    for name in ("a", "b", "c"):
        args = train_args(strategy, rounds=rounds, inner_steps=INNER_STEPS, min_peers=3)
        peers = (started[0].addr,) if started else ()
        daemon = DaemonProcess(tmp_path / name, peers=peers, extra_args=args, env=TRAIN_ENV).start()
        started.append(daemon)
        daemon.wait_ready(timeout=60)
    infos = wait_done(started, timeout=150)
    assert [i["rounds_completed"] for i in infos] == [rounds] * 3, infos
    assert len(final_hashes(started, rounds)) == 1
    for d in started:
        assert "done with 3 member(s)" in d.log(), d.log()
