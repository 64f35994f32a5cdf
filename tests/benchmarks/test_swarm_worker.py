"""The swarm-scale worker process (``lattica_lab.swarm_worker``) on loopback: real hosts, real
data planes, one process, driven through its JSON commands as ``lattica_lab.swarm.Swarm``
drives it in the WAN lab."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lattica_lab import lab_env
from lattica_lab.netlab import LabProcess

PEERS = 3
NUMEL = 256 * 1024  # 1 MiB fp32: [φ, Δ] is 2 MiB each way


@pytest.fixture
def worker():
    seeds = [os.urandom(32).hex() for _ in range(PEERS)]
    popen = subprocess.Popen(
        [sys.executable, "-m", "lattica_lab.swarm_worker", "127.0.0.1", *seeds],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, bufsize=1, env=lab_env(),
    )
    process = LabProcess("swarm-worker", popen)
    try:
        yield process
    finally:
        if popen.poll() is None:
            process.send({"cmd": "quit"})
        process.kill()


def _ask(worker: LabProcess, cmd: dict, event: str, timeout: float = 120) -> dict:
    worker.send(cmd)
    return worker.wait_for(lambda e: e.get("event") == event, timeout, fresh=True)


def _phase(name: str, members: list[str], **extra) -> dict:
    return {"cmd": "run", "phase": name, "mode": "gossip", "members": members, "numel": NUMEL,
            "grace_s": 5.0, "exchange_s": 20.0, "compute_s": 0.05, "seed": 3, "slow": {}, **extra}


def test_a_phase_cut_by_its_deadline_is_followed_by_a_warm_up_and_steps_on_fast_channels(worker):
    ready = worker.wait_for(lambda e: e.get("event") == "ready", 60)
    addrs = {p["peer_id"]: p["addr"] for p in ready["peers"]}
    members = sorted(addrs)
    connected = _ask(worker, {"cmd": "connect", "addrs": [addrs[m] for m in members], "members": members},
                     "connected")
    assert connected["ok"], connected["error"]
    primed = _ask(worker, {"cmd": "prime", "members": members, "tag": "prime/0"}, "primed")
    assert primed["ok"], primed["error"]

    # exchanges back to back until the deadline cancels them, sends in flight included
    _ask(worker, _phase("cut", members, round_base=100, end_at=time.time() + 2.0), "done")

    # a repeated fetch of the same tensor version is refused: the warm-up serves a fresh one
    for attempt in range(2):
        _ask(worker, {"cmd": "serve-warm"}, "served", 30)
        warmed = _ask(worker, {"cmd": "warm", "members": members}, "warmed")
        assert warmed["ok"], f"warm-up {attempt}: {warmed['error']}"

    done = _ask(worker, _phase("after", members, round_base=200, steps=3), "done")
    records = done["records"]
    assert sorted(records) == members
    for peer, steps in records.items():
        assert len(steps) == 3
        for step in steps:
            assert step["libp2p_bytes"] == 0  # every exchange on its fast channel
            assert peer in step["drawn"]
            assert set(step["drawn"]) <= set(members)
            assert step["key"] == f"round/{200 + step['step']}"
