"""A member whose training fails says so, and nobody waits for it.

Two ``lattica join --train`` daemons on loopback. The second reads its corpus from a named pipe;
the test lets the first load and wait for it at the start of the run ("waiting for peers to
load", bounded by ``START_WAIT_S``), then closes the pipe without writing: an empty corpus, so
the second's training fails while its daemon stays up and heartbeats. Its member record then
says ``failed`` instead of ``joining``, the first stops waiting for it and trains alone, without
the warning it logs when the start wait runs out on a member still loading.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from lattica.cli.render import short_id
from lattica_lab.daemons import DaemonProcess, run_cli, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    killed_at_end,
    log_from,
    train_args,
    training,
    wait_done,
)

DEADLINE_S = 2.0
ROUNDS = 2
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": str(DEADLINE_S)}
START_WAIT_RAN_OUT = "starting the run without the members still loading"


def _open_when_read(fifo: Path) -> int | None:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader yet
            return None
        raise
    return fd


def _role(daemon: DaemonProcess, peer: str) -> str | None:
    record = daemon.call("state")["members"].get(peer) or {}
    return record.get("role")


def test_a_member_whose_training_fails_is_not_waited_for(tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    args = train_args("diloco", rounds=ROUNDS, inner_steps=5, min_peers=2)
    with killed_at_end() as daemons:
        a = DaemonProcess(tmp_path / "a", extra_args=args, env=ENV).start()
        daemons.append(a)
        a.wait_ready(timeout=60)
        b = DaemonProcess(tmp_path / "b", peers=(a.addr,), extra_args=(*args, "--data", str(fifo)), env=ENV).start()
        daemons.append(b)
        b.wait_ready(timeout=60)
        b_id = b.peer_id
        pipe = wait_for(lambda: _open_when_read(fifo), timeout=60)  # b is loading
        assert pipe is not None, training(b)
        assert wait_for(lambda: training(a)["phase"] == "waiting for peers to load", timeout=60), training(a)
        assert _role(a, b_id) == "joining"
        os.close(pipe)  # an empty corpus: b's trainer cannot be built

        assert wait_for(lambda: training(b)["phase"] == "failed", timeout=30), training(b)
        assert "empty" in training(b)["error"]
        assert wait_for(lambda: _role(a, b_id) == "failed", timeout=30), a.call("state")["members"]
        wait_done([a], timeout=120)
        assert b.proc is not None
        assert b.proc.poll() is None  # the failed member's daemon is still up
        assert b_id in a.call("state")["live"]
        assert training(a)["failed_members"] == [b_id]
        log = log_from(a)
        assert "sync round/0 done with 1 member" in log, log[-4000:]
        assert START_WAIT_RAN_OUT not in log, log[-4000:]

        table = run_cli("state", "--data-dir", str(a.data_dir))
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if line.startswith(short_id(b_id)))
        assert row.split()[1:3] == ["yes", "failed"], table.stdout
