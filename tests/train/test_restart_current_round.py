"""A restarted trainer's first round is the swarm's current one, not its checkpoint's.

Two ``lattica join --train`` daemons on loopback (tiny model, DiLoCo): ``b`` is killed and
restarted with its data dir while ``a`` trains on alone. Before, ``a`` held back every round it
ran alone for a catch-up wait (the others' result of it might still come), although the only
other member was restarting: the restarted ``b`` found only the round before published, resumed
its checkpoint's round — one ``a`` had already run — and ran it alone (or waited a round
deadline for ``a``) before it adopted ``a``'s newer state.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, wait_for
from lattica_lab.training_daemons import SYNC, TRAIN_ENV, killed_at_end, log_from, train_args, training

INNER_STEPS = 10
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "5"}
RESUMED = re.compile(r"resumed at step (\d+)")


def _trainer(path: Path, *, port: int | None = None, peers: tuple[str, ...] = ()) -> DaemonProcess:
    args = train_args("diloco", rounds=5000, inner_steps=INNER_STEPS, min_peers=2)
    if port is None:
        return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)
    return DaemonProcess(path, port=port, peers=peers, extra_args=args, env=ENV)


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    with killed_at_end() as started:
        yield started


def test_a_restarted_trainer_first_syncs_in_the_swarms_current_round(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a = _trainer(tmp_path / "a").start()
    daemons.append(a)
    a.wait_ready(60)
    b = _trainer(tmp_path / "b", peers=(a.addr,)).start()
    daemons.append(b)
    b.wait_ready(60)
    assert wait_for(lambda: all(training(d).get("rounds_completed", 0) >= 2 for d in (a, b)), 120), a.log()

    offset = len(log_from(b))
    b.kill()
    again = _trainer(tmp_path / "b", port=b.port, peers=(a.addr,)).start()
    daemons.append(again)
    again.wait_ready(60)
    assert wait_for(lambda: len(_syncs(log_from(again, offset))) >= 2, 60), log_from(again, offset)[-6000:]
    log = log_from(again, offset)
    syncs = _syncs(log)[:2]
    assert syncs, log[-6000:]
    resumed = RESUMED.search(log)
    assert resumed, log[-6000:]
    checkpoint_round = int(resumed.group(1)) // INNER_STEPS
    # its first round is one a reached while b restarted, past the one b's checkpoint stood at
    assert syncs[0][0] > checkpoint_round, log[-6000:]
    # and it trains with a at once: a races on alone (a round of one takes no time) until b
    # says it trains, so b may reach one more round a has just sealed, and adopt a's result
    assert 2 in [members for _, members in syncs], log[-6000:]


def _syncs(log: str) -> list[tuple[int, int]]:
    """(round, members) of each completed sync in ``log``, in order."""
    return [(int(m.group(1)), int(m.group(2))) for m in SYNC.finditer(log)]
