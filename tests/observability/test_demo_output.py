"""``lattica demo`` off a terminal: one line per node when something changed, received bytes
filled in, the phases the nodes go through — read from a real two-node demo run (the
daemons' threads as the demo chooses them: no ``OMP_NUM_THREADS`` of the test's own)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess

from lattica_lab.daemons import lattica_command

LINE = re.compile(r"^\[(node\d+)\] round=(\S+) .* bytes_received=(\S+)$")
PHASE = re.compile(r" phase=(\S+) ")


def test_demo_prints_changes_only_and_received_bytes(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LATTICA_") and k != "OMP_NUM_THREADS"},
        "LATTICA_TRAIN_BATCH_SIZE": "4", "LATTICA_TRAIN_SEQ_LEN": "32",
        "LATTICA_TRAIN_WARMUP_STEPS": "2",
    }
    result = subprocess.run(
        lattica_command(
            "demo", "--nodes", "2", "--rounds", "3", "--inner-steps", "5", "--workdir", str(tmp_path),
        ),
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    progress = [m for line in result.stdout.splitlines() if (m := LINE.match(line))]
    assert {m.group(1) for m in progress} == {"node0", "node1"}, result.stdout
    for node in ("node0", "node1"):
        lines = [m.group(0) for m in progress if m.group(1) == node]
        assert all(a != b for a, b in itertools.pairwise(lines)), lines  # never the same line again
        last = [m for m in progress if m.group(1) == node][-1]
        assert last.group(2) == "3"
        assert last.group(3) != "-"
        assert not last.group(3).startswith("0B"), last.group(0)
        phases = [p for line in lines if (p := PHASE.search(line))]
        assert phases[0].group(1) != "done", lines  # from the start ...
        assert phases[-1].group(1) == "done", lines  # ... to the end
    summary = result.stdout.split("Lattica demo", 1)[1]
    assert "received" in summary  # the summary table too
    assert "first_loss" in summary
    assert "replicas identical: yes" in summary
    assert re.search(r"^demo finished in \d+ s$", summary, re.MULTILINE), summary
