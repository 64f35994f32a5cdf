"""kill -9 at random moments while checkpoints are written: the newest acknowledged one loads.

The state log's kill -9 test is ``tests/crdt/test_crdt_log.py``; whole daemons killed and
restarted are ``tests/train/test_swarm_training.py`` and ``benchmarks/chaos.py``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lattica.train.engine.checkpoint import CheckpointStore

WORKER = Path(__file__).with_name("checkpoint_worker.py")


def test_kill_9_during_checkpoint_writes_loses_no_acknowledged_step(tmp_path) -> None:
    rng = random.Random(0)
    acknowledged = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()  # started and saved at least once
            assert first.strip(), "worker did not start"
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        lines = [first, *proc.stdout.read().splitlines()]
        acknowledged = max(acknowledged, *(int(x) for x in lines if x.strip()))
        latest = CheckpointStore(tmp_path, keep=2).load_latest()
        assert latest is not None
        assert latest["step"] >= acknowledged
        assert latest["w"].shape == (256, 1024)  # loads fully
    # torn temporaries of the killed writers never shadow a real checkpoint, and the next
    # store opened on the folder removes them (they used to pile up, one per kill)
    CheckpointStore(tmp_path, keep=2)
    names = [p.name for p in tmp_path.iterdir()]
    assert names
    assert all(n.startswith("step-") for n in names), names
