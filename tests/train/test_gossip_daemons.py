"""Gossip averaging between real ``lattica join --train`` daemons: no global barrier.

One daemon is frozen (SIGSTOP) for longer than the group grace and several rounds: the others
keep completing outer steps — a peer only ever waits for its own group, at most the grace —
and after SIGCONT the frozen one catches up (it adopts the newest published replica, being
rounds behind), syncs in groups again, and its measured spread is the swarm's again.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    killed_at_end,
    paired_syncs,
    rounds_completed,
    train_args,
    training,
)

INNER_STEPS = 4
GRACE_S = 3.0  # also what realigns peers started apart: the one ahead waits up to it for its partner
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "5", "LATTICA_TRAIN_GROUP_GRACE_S": str(GRACE_S)}


def _trainer(
    path: Path, *, rounds: int, peers: tuple[str, ...], min_peers: int, strategy: str, overlap: bool = False
) -> DaemonProcess:
    gossip = ("--averaging", "gossip") if strategy == "diloco" else ()
    args = (
        *train_args(strategy, rounds=rounds, inner_steps=INNER_STEPS, min_peers=min_peers),
        *gossip, "--group-size", "2", *(("--gossip-overlap",) if overlap else ()),
    )
    return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def _swarm(
    tmp_path: Path, daemons: list[DaemonProcess], count: int, rounds: int, strategy: str = "diloco",
    overlap: bool = False,
) -> list[DaemonProcess]:
    ready_s = 60.0 + 10.0 * count  # several daemons starting at once on a loaded 2-core machine
    first = _trainer(tmp_path / "p0", rounds=rounds, peers=(), min_peers=count, strategy=strategy,
                     overlap=overlap).start()
    daemons.append(first)
    first.wait_ready(ready_s)
    others = [
        _trainer(tmp_path / f"p{i}", rounds=rounds, peers=(first.addr,), min_peers=count, strategy=strategy,
                 overlap=overlap).start()
        for i in range(1, count)
    ]
    daemons.extend(others)
    for d in others:
        d.wait_ready(ready_s)
    return [first, *others]


def _frozen_peer_does_not_hold_the_others(
    swarm: list[DaemonProcess], *, freeze_s: float, align_s: float = 30.0
) -> None:
    assert wait_for(lambda: all(rounds_completed(d) >= 1 for d in swarm), 60), [d.log() for d in swarm]
    assert wait_for(lambda: all(paired_syncs(d) >= 1 for d in swarm), align_s), [d.log() for d in swarm]
    frozen, others = swarm[-1], swarm[:-1]
    frozen.signal(signal.SIGSTOP)
    at_freeze = {d.data_dir: rounds_completed(d) for d in others}
    started = time.monotonic()
    # every other peer keeps completing outer steps while one member is frozen (a round with
    # the frozen peer as partner costs at most the grace); frozen well beyond the grace
    kept_going = wait_for(lambda: all(rounds_completed(d) >= at_freeze[d.data_dir] + 3 for d in others), 60)
    progressed = {d.data_dir.name: rounds_completed(d) - at_freeze[d.data_dir] for d in others}
    assert kept_going, (progressed, time.monotonic() - started)
    time.sleep(max(0.0, freeze_s - (time.monotonic() - started)))
    assert frozen.log_path is not None
    resumed_at = len(frozen.log_path.read_text())
    frozen.signal(signal.SIGCONT)
    # it rejoins: completes rounds again, syncs in a group again, and measures the swarm's spread
    before = rounds_completed(frozen)
    assert wait_for(lambda: rounds_completed(frozen) >= before + 2, 30), frozen.log()
    assert wait_for(lambda: paired_syncs(frozen, resumed_at) >= 1, 30), frozen.log()
    spreads = [training(d).get("consensus_distance") for d in swarm]
    assert all(s is not None and 0 <= s < 0.5 for s in spreads), spreads
    for d in swarm:
        info = training(d)
        assert info["averaging"] == "gossip"
        assert info["replicas_agree"] is False


# overlapped gossip (its exchanges in flight through the freeze and the adoption) for the suite's
# time among the slow ones (the default set runs overlap in tests/train/test_gossip_overlap_daemons.py)
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_four_gossip_daemons_keep_training_while_one_is_frozen(
    tmp_path: Path, daemons: list[DaemonProcess], overlap: bool
) -> None:
    swarm = _swarm(tmp_path, daemons, 3, rounds=400, overlap=overlap)
    assert wait_for(lambda: all(rounds_completed(d) >= 2 for d in swarm), 90), [d.log() for d in swarm]
    # a joiner adopts the newest published replica (replicas differ: no majority hash), then gossips
    joiner = _trainer(tmp_path / "p3", rounds=400, peers=(swarm[0].addr,), min_peers=3, strategy="diloco",
                      overlap=overlap).start()
    daemons.append(joiner)
    joiner.wait_ready(60)
    assert wait_for(lambda: "adopted outer state of round" in joiner.log(), 60), joiner.log()
    assert rounds_completed(joiner) >= 2
    _frozen_peer_does_not_hold_the_others([*swarm, joiner], freeze_s=4 * GRACE_S)
    status = run_cli("status", "--data-dir", str(joiner.data_dir))
    assert status.returncode == 0, status.stderr
    assert re.search(r"consensus distance\s+0\.\d+", status.stdout), status.stdout


@pytest.mark.slow  # for the suite's time (8 daemons)
@pytest.mark.parametrize("overlap", [False, True])
def test_eight_gossip_daemons_keep_training_while_one_is_frozen(
    tmp_path: Path, daemons: list[DaemonProcess], overlap: bool
) -> None:
    swarm = _swarm(tmp_path, daemons, 8, rounds=400, overlap=overlap)
    _frozen_peer_does_not_hold_the_others(swarm, freeze_s=6 * GRACE_S, align_s=120.0)


def test_noloco_daemons_pair_up_without_a_coordinator(tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    """NoLoCo as its paper defines it: groups of 2 from the round number, no global blocking."""
    swarm = _swarm(tmp_path, daemons, 3, rounds=400, strategy="noloco")
    assert wait_for(lambda: all(rounds_completed(d) >= 2 for d in swarm), 90), [d.log() for d in swarm]
    assert wait_for(lambda: all(paired_syncs(d) >= 1 for d in swarm), 60), [d.log() for d in swarm]
    for d in swarm:
        info = training(d)
        assert info["averaging"] == "gossip"
        assert info["replicas_agree"] is False
    spreads = [training(d).get("consensus_distance") for d in swarm]
    assert all(s is not None and 0 <= s < 0.5 for s in spreads), spreads


# The frozen-peer scenario with NoLoCo: the same coordinator-free groups as the DiLoCo gossip case
# above (tests/train/test_noloco.py::test_dead_partner_is_left_out_without_stalling_the_others and
# test_gossip_realign.py::test_noloco_behind_jumps_to_the_swarms_step_and_keeps_the_offset cover
# NoLoCo's side of it on real hosts)
@pytest.mark.slow
def test_noloco_daemons_keep_training_while_one_is_frozen(tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    swarm = _swarm(tmp_path, daemons, 3, rounds=400, strategy="noloco")
    _frozen_peer_does_not_hold_the_others(swarm, freeze_s=3 * GRACE_S)
