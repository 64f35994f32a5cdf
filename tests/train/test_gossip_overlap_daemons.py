"""Overlapped gossip between real ``lattica join --train`` daemons (``gossip_overlap = true``).

Three DiLoCo daemons average in pairs with each round's exchange running during the next inner
phase: every daemon finishes its rounds, lands every round it launched (the first sync lands
nothing, ``finish`` lands the last), averages with a partner in most of them, and reports the
setting in ``lattica status``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica.train.strategies.diloco import FIRST_IN_FLIGHT
from lattica_lab.daemons import DaemonProcess
from lattica_lab.training_daemons import (
    killed_at_end,
    paired_syncs,
    start_gossip_trainers,
    wait_done,
)

INNER_STEPS = 4
ROUNDS = 6


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def test_three_daemons_with_overlapped_gossip_land_every_round(tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    start_gossip_trainers(tmp_path, daemons, 3, "diloco", rounds=ROUNDS, inner_steps=INNER_STEPS,
                          extra=("--gossip-overlap",))
    infos = wait_done(daemons, 240)
    for d, info in zip(daemons, infos, strict=True):
        assert info["averaging"] == "gossip"
        assert info["gossip_overlap"] is True
        assert info["replicas_agree"] is False
        # ROUNDS syncs launched ROUNDS exchanges: the first sync landed none, finish the last
        assert info["rounds_completed"] == ROUNDS, d.log()
        assert FIRST_IN_FLIGHT in d.log()
    assert sum(paired_syncs(d) for d in daemons) >= ROUNDS, [d.log() for d in daemons]
