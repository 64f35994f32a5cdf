"""SparseLoCo and DeMo across real ``lattica join --train`` processes on loopback.

Three daemons (tiny model, 5 inner steps, batch 4) train a few rounds over the real data plane;
both strategies promise bit-identical replicas, which the published outer-state hashes show.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, free_port, wait_for
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


def _start(root: Path, names: list[str], strategy: str, rounds: int, daemons: list[DaemonProcess],
           metrics_port: int) -> None:
    for i, name in enumerate(names):
        args = train_args(strategy, rounds=rounds, inner_steps=INNER_STEPS, min_peers=len(names))
        if i == 0:
            args += ("--metrics-addr", f"127.0.0.1:{metrics_port}")
        peers = (daemons[0].addr,) if daemons else ()
        daemon = DaemonProcess(root / name, peers=peers, extra_args=args, env=TRAIN_ENV).start()
        daemons.append(daemon)
        daemon.wait_ready(timeout=60)


def _metric(daemon: DaemonProcess, name: str) -> float:
    # the exporter falls back to another port when the asked one is taken: read it from the log
    found = re.search(r"metrics exporter listening on (http://\S+/metrics)", daemon.log())
    assert found, daemon.log()
    with urllib.request.urlopen(found.group(1), timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"metric {name} not exported")


DENSE_ROUND_BYTES = 124_672 * 4 * 2 * 2 // 3  # one fp32 all-reduce of the tiny model over 3 members


# DeMo syncs every inner step, but agrees on its group once per round (H steps), not per step
@pytest.mark.parametrize(("strategy", "rounds"), [("sparseloco", 3), ("demo", 2)])
def test_three_daemons_stay_bit_identical(tmp_path: Path, started: list[DaemonProcess], strategy: str,
                                          rounds: int) -> None:
    port = free_port()
    _start(tmp_path, ["a", "b", "c"], strategy, rounds, started, port)
    infos = wait_done(started, timeout=120)
    assert [i["rounds_completed"] for i in infos] == [rounds] * 3, infos
    assert len(final_hashes(started, rounds)) == 1
    # at least one sync with all three over the real data plane; on a loaded machine a member
    # can still run a round alone (a coordinator counts a member whose first publication has
    # not reached it yet as behind), and the daemon's catch-up then adopts the swarm's state:
    # the published hashes above are what the strategy promises
    for d in started:
        assert "done with 3 member(s)" in d.log(), d.log()
    syncs = rounds if strategy == "sparseloco" else rounds * INNER_STEPS
    # the daemon copies the strategy's figures into its metrics once a second: a run this
    # short can be done before the first copy after its syncs
    assert wait_for(lambda: _metric(started[0], "lattica_strategy_bytes_sent_total") > 0, 10)
    sent = _metric(started[0], "lattica_strategy_bytes_sent_total")
    assert 0 < sent < syncs * DENSE_ROUND_BYTES / 20, sent  # sparse: far below dense all-reduces
    assert 0 < _metric(started[0], "lattica_strategy_syncs_total") <= syncs
