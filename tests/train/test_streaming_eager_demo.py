"""``lattica demo --strategy streaming_eager``: two real daemons train Streaming DiLoCo with eager
fragment updates over the real data plane, finish, and end with identical outer states.

Every fragment sync of both is one group of both, so both apply the same means in the same order:
the published hashes of the outer weights and momentum must be equal. They differed when a peer
whose first progress record had not reached the other yet counted as behind it, lost its
coordinator role there, and each side sealed the last fragment syncs alone."""

from __future__ import annotations

import json
import os
import subprocess

from lattica_lab.daemons import lattica_command


def test_demo_runs_streaming_eager(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LATTICA_")},
        "LATTICA_TRAIN_BATCH_SIZE": "4", "LATTICA_TRAIN_SEQ_LEN": "32",
        "LATTICA_TRAIN_WARMUP_STEPS": "2", "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        lattica_command(
            "demo", "--json", "--nodes", "2", "--rounds", "3", "--inner-steps", "4",
            "--strategy", "streaming_eager", "--workdir", str(tmp_path),
        ),
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["strategy"] == "streaming_eager", summary
    assert summary["ok"], summary
    assert summary["replicas_identical"], summary
    for node in summary["nodes"].values():
        assert node["phase"] == "done", summary
        assert node["rounds"] >= 2, summary  # 5 fragment syncs of P = 2 in 12 steps
        assert node["bytes_sent"] > 0, summary
