"""The swarm-scale worker (``lattica_lab.swarm_worker``) ends cleanly on ``quit``: its hosts are
closed inside the nursery their data planes and gossip groups run in, with a phase still
stepping, and nothing lands in its log (the harness keeps each worker's stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lattica_lab import lab_env
from lattica_lab.netlab import LabProcess

PEERS = 3


def _ask(worker: LabProcess, cmd: dict, event: str, timeout: float = 120) -> dict:
    worker.send(cmd)
    return worker.wait_for(lambda e: e.get("event") == event, timeout, fresh=True)


def test_quit_during_a_phase_ends_the_worker_without_a_traceback(tmp_path: Path) -> None:
    seeds = [os.urandom(32).hex() for _ in range(PEERS)]
    log = tmp_path / "worker.log"
    with log.open("w") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "lattica_lab.swarm_worker", "127.0.0.1", *seeds],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=lab_env(),
        )
    worker = LabProcess("swarm-worker", popen)
    try:
        ready = worker.wait_for(lambda e: e.get("event") == "ready", 60)
        addrs = {p["peer_id"]: p["addr"] for p in ready["peers"]}
        members = sorted(addrs)
        connected = _ask(worker, {"cmd": "connect", "addrs": [addrs[m] for m in members], "members": members},
                         "connected")
        assert connected["ok"], connected["error"]
        phase = {"cmd": "run", "phase": "lingering", "mode": "gossip", "members": members, "numel": 1024,
                 "grace_s": 2.0, "exchange_s": 10.0, "compute_s": 0.05, "seed": 1, "slow": {}, "round_base": 0,
                 "steps": 2, "linger": True}
        _ask(worker, phase, "reached")  # its peers step on, gossip groups and exchanges in flight
        worker.send({"cmd": "quit"})
        assert popen.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        worker.kill()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
