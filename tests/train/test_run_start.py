"""The first round of a run is everyone's, however long a member takes to load.

Two ``lattica join --train`` daemons on loopback. The second reads its corpus from a named pipe
that the test fills only several round deadlines after the first daemon has loaded (a corpus on
a slow disk or share; fetching a claim that turns out unservable takes as long). The first waits
for the member it saw announce itself, instead of running the first rounds alone — a round
coordinator waits one round deadline from the first arrival, and loading is no part of a round.
"""

from __future__ import annotations

import errno
import os
import sysconfig
import time
from pathlib import Path

from lattica_lab.daemons import DaemonProcess, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    killed_at_end,
    log_from,
    sync_members,
    train_args,
    training,
    wait_done,
)

DEADLINE_S = 2.0
ROUNDS = 2
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": str(DEADLINE_S)}


def _corpus() -> bytes:
    """Some text: the first few hundred KiB of the standard library's own sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:40])
    return text[:400_000]


def _open_when_read(fifo: Path) -> int | None:
    """A write end of ``fifo`` once a process holds it open for reading (None before); the
    reader then waits for what is written until this end is closed."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader yet
            return None
        raise
    os.set_blocking(fd, True)
    return fd


def test_a_member_still_loading_at_the_start_shares_the_first_round(tmp_path: Path) -> None:
    fifo = tmp_path / "slow-corpus.txt"
    os.mkfifo(fifo)
    args = train_args("diloco", rounds=ROUNDS, inner_steps=5, min_peers=2)
    with killed_at_end() as daemons:
        a = DaemonProcess(tmp_path / "a", extra_args=args, env=ENV).start()
        daemons.append(a)
        a.wait_ready(timeout=60)
        b = DaemonProcess(tmp_path / "b", peers=(a.addr,), extra_args=(*args, "--data", str(fifo)), env=ENV).start()
        daemons.append(b)
        b.wait_ready(timeout=60)
        pipe = wait_for(lambda: _open_when_read(fifo), timeout=60)  # b is loading
        assert pipe is not None, training(b)
        # a has loaded and would be in its first round's inner steps: hold b's corpus back for
        # several round deadlines more
        assert wait_for(lambda: training(a)["phase"] in ("waiting for peers to load", "training"), timeout=60)
        time.sleep(4 * DEADLINE_S)
        assert training(b)["phase"] == "loading"
        with os.fdopen(pipe, "wb") as corpus:
            corpus.write(_corpus())
        wait_done([a, b], timeout=120)
        for daemon in (a, b):
            assert sync_members(log_from(daemon)) == [2] * ROUNDS, log_from(daemon)[-4000:]
