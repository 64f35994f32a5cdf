"""``scripts/gpu_check.sh`` (``lattica_lab.gpu_check``): what it runs, how it judges a phase, and
(slow) its dry run on the CPU end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lattica.cli.main import build_parser
from lattica_lab import gpu_check
from lattica_lab.benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[2]


def _phases(device: str, *, quick: bool, ranks: bool = False) -> dict[str, gpu_check.Phase]:
    return {p.name: p for group in gpu_check.plan(device, quick=quick, ranks=ranks) for p in group}


@pytest.mark.parametrize("ranks", [False, True])
@pytest.mark.parametrize("quick", [False, True])
def test_every_phase_is_a_command_its_script_accepts(quick: bool, ranks: bool) -> None:
    for phase in _phases("cuda", quick=quick, ranks=ranks).values():
        if phase.args[0] == "-m":
            assert phase.args[1] == "lattica.cli.main"
            assert build_parser().parse_args(list(phase.args[2:])).command == "demo"
        else:
            script = load(Path(phase.args[0]).stem)
            script.parse_args(list(phase.args[1:]))


def test_the_full_check_measures_what_the_gpu_targets_need() -> None:
    phases = _phases("cuda", quick=False)
    throughput = phases["throughput"].args
    assert "gpt2-124m,gpt-350m" in throughput
    assert load("throughput").SHAPES["gpt2-124m"] == (32, 1024)
    assert load("throughput").SHAPES["gpt-350m"] == (16, 1024)
    convergence = load("convergence").parse_args(list(phases["convergence"].args[1:]))
    assert (convergence.model, convergence.device, convergence.steps) == ("medium", "cuda", 2000)
    assert set(convergence.strategies.split(",")) == {"ddp", "diloco"}
    assert "--nodes" in phases["daemons"].args
    assert phases["daemons"].env["LATTICA_TRAIN_DEVICE"] == "cuda"
    # the groups run one after the other: the longest phase of each, at most five minutes
    assert sum(max(p.timeout_s for p in group) for group in gpu_check.plan("cuda", quick=False)) <= 300


def test_the_ranks_check_runs_a_node_of_every_gpu_within_five_minutes() -> None:
    phases = _phases("cuda", quick=False, ranks=True)
    assert load("throughput").parse_args(list(phases["ranks_throughput"].args[1:])).devices == "auto"
    assert phases["ranks_daemons"].env["LATTICA_TRAIN_DEVICES"] == "auto"
    assert sum(max(p.timeout_s for p in group) for group in gpu_check.plan("cuda", quick=False, ranks=True)) <= 300
    assert _phases("cpu", quick=True, ranks=True)["ranks_daemons"].env["LATTICA_TRAIN_DEVICES"] == "cpu:2"


def test_a_phase_passes_only_when_it_exits_0_in_time_with_a_json_line_that_is_not_a_failure() -> None:
    good = gpu_check.phase_record(returncode=0, seconds=1.0, output='table\n{"x": 1}\n', timed_out=False)
    assert good["ok"]
    assert good["result"] == {"x": 1}
    assert "error" not in good
    for returncode, output, timed_out in [
        (1, '{"x": 1}', False),                     # failed
        (0, "no figures", False),                   # no JSON line
        (0, '{"ok": false, "nodes": {}}', False),  # the demo's replicas differ
        (None, '{"x": 1}', True),                   # ran over its time
    ]:
        record = gpu_check.phase_record(returncode=returncode, seconds=2.0, output=output, timed_out=timed_out)
        assert not record["ok"], (returncode, output)
        assert record["error"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dry_run_on_the_cpu_passes_and_ends_with_one_json_line() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick"],
        capture_output=True, text=True, timeout=580, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"]
    assert set(summary["phases"]) == {"throughput", "daemons", "convergence", "placement"}
    assert summary["phases"]["daemons"]["result"]["replicas_identical"]
    assert summary["phases"]["placement"]["result"]["cpu_matches_cpu_member"]
