"""The container deployment end to end: ``scripts/docker_smoke.sh`` (slow; needs Docker).

The script builds the CPU image, runs the compose stack (bootstrap + 2 training peers +
Prometheus), lets a port-mapped node from outside the compose network join, restarts the stack
and checks that training resumes; its one JSON line is the verdict.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docker_smoke.sh"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def docker_usable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI"
    if shutil.which("docker-compose") is None:
        return "no docker-compose"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0:
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return "no Docker daemon running, and none can be started here"
    return None


def test_docker_smoke_all_true():
    reason = docker_usable()
    if reason:
        pytest.skip(reason)
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=3500)
    assert out.returncode == 0, out.stderr[-4000:]
    [line] = out.stdout.strip().splitlines()
    print(line)  # the figures (pytest -s or -rP shows them)
    result = json.loads(line)
    assert all(v is not False for v in result.values()), (result, out.stderr[-3000:])
    assert result["image_mb"] > 0
    assert result["build_s"] >= 0
    assert result["peers_joined"] >= 3  # peer-1, peer-2 and the node outside the compose network
    assert result["rounds"] == 4  # 2 before the restart, 2 after
    assert result["replicas_identical"] is True
    assert result["scraped_targets"] == 3
    assert result["resumed"] is True
    assert result["healthy"] is True
    assert result["non_root"] is True
    assert result["outside_peer_joined"] is True
