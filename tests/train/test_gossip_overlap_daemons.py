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
    TRAIN_ENV,
    killed_at_end,
    paired_syncs,
    train_args,
    wait_done,
)

INNER_STEPS = 4
ROUNDS = 6
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "5", "LATTICA_TRAIN_GROUP_GRACE_S": "3.0"}


def _trainer(path: Path, peers: tuple[str, ...]) -> DaemonProcess:
    args = (
        *train_args("diloco", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=3),
        "--averaging", "gossip", "--gossip-overlap",
    )
    return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def test_three_daemons_with_overlapped_gossip_land_every_round(tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    first = _trainer(tmp_path / "p0", ()).start()
    daemons.append(first)
    first.wait_ready(60)
    for i in (1, 2):
        daemons.append(_trainer(tmp_path / f"p{i}", (first.addr,)).start())
    for d in daemons[1:]:
        d.wait_ready(60)
    infos = wait_done(daemons, 240)
    for d, info in zip(daemons, infos, strict=True):
        assert info["averaging"] == "gossip"
        assert info["gossip_overlap"] is True
        assert info["replicas_agree"] is False
        # ROUNDS syncs launched ROUNDS exchanges: the first sync landed none, finish the last
        assert info["rounds_completed"] == ROUNDS, d.log()
        assert FIRST_IN_FLIGHT in d.log()
    assert sum(paired_syncs(d) for d in daemons) >= ROUNDS, [d.log() for d in daemons]
