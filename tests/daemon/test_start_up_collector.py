"""``lattica join`` starts without Python's cyclic garbage collector running over its imports.

The start-up runs in a fresh interpreter (a test process has torch and py-libp2p imported
already); the daemon itself is replaced by a probe that reports what the collector did, so
the test looks at the start-up only: the real argument parsing, config, checks and imports of a
trainer daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PROBE = """
import gc, json, sys, types

collections = []
daemon = types.ModuleType("lattica.node.daemon")

def run_until_stopped(config, key_pair, **kwargs):
    print(json.dumps({
        "collections_during_start_up": len(collections), "enabled": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
    }))
    return 0

daemon.run_until_stopped = run_until_stopped
sys.modules["lattica.node.daemon"] = daemon  # the probe stands in for the running daemon
from lattica.cli import commands
from lattica.cli.main import main

join = commands.join

def watched_join(args):  # collections are counted from here on
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
    return join(args)

commands.join = watched_join
sys.exit(main(sys.argv[1:]))
"""


def test_a_trainer_daemon_imports_with_the_collector_paused_then_frozen(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "join", "--data-dir", str(tmp_path / "node"), "--listen",
         "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off", "--train", "--model", "tiny", "--device", "cpu"],
        capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["collections_during_start_up"] == 0, report  # torch, py-libp2p: not scanned over and over
    assert report["enabled"] is True, report  # the running daemon collects as before
    assert report["frozen"] > 100_000, report  # the start-up's objects: never scanned again
