"""A member publishes and serves a poisoned outer state claimed ahead: the honest trainers refuse it.

Real ``lattica join --train`` daemons on loopback; the hostile one (``poisoned_state_daemon.py``)
trains and syncs like the others but publishes, with its true hash, a state claimed rounds ahead
of its own:

- gossip (three members, pairs): a malformed manifest (``round: "not-a-round"``), claimed 50
  and 4 rounds ahead in turn. The honest trainers — whose newest-round rule would pick it —
  refuse it (50 ahead: implausible next to the other honest member's round; 4 ahead: fetched,
  and its manifest fails the schema), say so once, and keep training; none goes ``failed``;
- all-reduce with two members: NaN weights, claimed 20 rounds ahead. The other
  member fetches it (with two members nobody else can corroborate or contradict a claim),
  refuses it for its non-finite weights and finishes the run on its own state: finite loss,
  ``rounds_completed`` the run's ``rounds``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, wait_for
from lattica_lab.training_daemons import (
    GOSSIP_ENV,
    TRAIN_ENV,
    killed_at_end,
    log_from,
    rounds_completed,
    train_args,
    training,
    wait_done,
)

SCRIPT = Path(__file__).with_name("poisoned_state_daemon.py")
REFUSED = "refused the outer state of round"


@dataclass
class PoisonedStateDaemon(DaemonProcess):
    """``lattica join`` through ``poisoned_state_daemon.py``: publishes ``poison`` claimed ahead."""

    poison: str = "manifest"
    ahead: tuple[int, ...] = (50,)

    def command(self) -> list[str]:
        offsets = ",".join(str(n) for n in self.ahead)
        return [sys.executable, str(SCRIPT), self.poison, offsets, *self.join_args()]


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def _never_failed(honest: list[DaemonProcess]) -> bool:
    for d in honest:
        info = training(d)
        assert info["phase"] != "failed", (info, log_from(d)[-4000:])
    return True


def _claimed_round(observer: DaemonProcess, peer: str) -> int:
    record = observer.call("state")["progress"].get(peer) or {}
    return int(record.get("round") or 0)


def test_gossip_trainers_refuse_a_malformed_state_claimed_ahead(tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    args = (*train_args("diloco", rounds=400, inner_steps=4, min_peers=3), "--averaging", "gossip", "--group-size", "2")
    first = DaemonProcess(tmp_path / "p0", extra_args=args, env=GOSSIP_ENV).start()
    daemons.append(first)
    first.wait_ready(60)
    second = DaemonProcess(tmp_path / "p1", peers=(first.addr,), extra_args=args, env=GOSSIP_ENV).start()
    hostile = PoisonedStateDaemon(
        tmp_path / "hostile", peers=(first.addr,), extra_args=args, env=GOSSIP_ENV, poison="manifest", ahead=(50, 4),
    ).start()
    daemons.extend([second, hostile])
    honest = [first, second]
    for d in (second, hostile):
        d.wait_ready(60)
    hostile_id = hostile.peer_id

    # the poisoned claim is out, ahead of every honest replica
    assert wait_for(lambda: _never_failed(honest) and _claimed_round(first, hostile_id) > 0, 90), hostile.log()
    at_claim = {d.data_dir: rounds_completed(d) for d in honest}
    # the honest trainers keep training past it, and none stops
    kept_going = wait_for(
        lambda: _never_failed(honest) and all(rounds_completed(d) >= at_claim[d.data_dir] + 6 for d in honest), 60,
    )
    assert kept_going, [(training(d), log_from(d)[-3000:]) for d in honest]
    for d in honest:
        info = training(d)
        assert info["rounds_completed"] <= 400
        assert math.isfinite(info["loss"]), info
        assert wait_for(lambda d=d: REFUSED in log_from(d), 30), log_from(d)[-3000:]
        refusals = [line for line in log_from(d).splitlines() if REFUSED in line]
        assert all(hostile_id in line for line in refusals), refusals
        assert len(refusals) <= 2, refusals  # once per reason (implausible, malformed), not per poll
    # the claim 4 rounds ahead was fetched by whoever was behind it, and refused for its manifest
    malformed = "'round' is not a valid count: 'not-a-round'"
    assert wait_for(lambda: any(malformed in log_from(d) for d in honest), 60), [log_from(d)[-3000:] for d in honest]
    assert any(training(d).get("refused_states") == {hostile_id: 1} for d in honest), [training(d) for d in honest]


def test_a_nan_state_claimed_ahead_is_not_adopted_in_a_two_member_allreduce(
    tmp_path: Path, daemons: list[DaemonProcess],
) -> None:
    rounds = 30
    args = train_args("diloco", rounds=rounds, inner_steps=2, min_peers=2)
    env = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "5"}
    honest = DaemonProcess(tmp_path / "honest", extra_args=args, env=env).start()
    daemons.append(honest)
    honest.wait_ready(60)
    hostile = PoisonedStateDaemon(
        tmp_path / "hostile", peers=(honest.addr,), extra_args=args, env=env, poison="nan", ahead=(20,),
    ).start()
    daemons.append(hostile)
    hostile.wait_ready(60)
    hostile_id = hostile.peer_id

    info = wait_done([honest], 150)[0]
    assert info["rounds_completed"] == rounds, info
    assert math.isfinite(info["loss"]), info
    assert math.isfinite(info["summary"]["train_loss"]), info
    log = log_from(honest)
    assert "adopted outer state" not in log, log[-4000:]
    refusals = [line for line in log.splitlines() if REFUSED in line]
    assert len(refusals) == 1, refusals  # logged once; the holder's later claims are not fetched again
    assert hostile_id in refusals[0], refusals
    assert "not finite" in refusals[0], refusals
    assert info["refused_states"] == {hostile_id: 1}, info
