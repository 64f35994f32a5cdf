"""``benchmarks/swarm_scale.py``: a phase that did not finish fails the run, never a number.

The summaries are pure functions, fed here what an unfinished phase leaves behind. Two real
runs: without root the benchmark exits with its reason, and (as root, with the WAN lab) the
smallest configuration runs end to end on real hosts and prints figures that hold together.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lattica_lab.wan import wan_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "swarm_scale.py"


@pytest.fixture(scope="module")
def swarm():
    """The benchmark script as a module (its helper ``_checkout`` importable, as when run)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.append(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("_bench_swarm_scale", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(i: int, t0: float, t1: float, *, group: int = 2, skipped: bool = False, sample=None) -> dict:
    record = {"step": i, "t0": t0, "t1": t1, "group": group, "bytes": 1000, "skipped": skipped, "detail": ""}
    if sample is not None:
        record["sample"] = sample
    return record


def test_a_peer_that_reported_nothing_or_too_few_steps_fails_the_phase(swarm):
    peers = ["a", "b", "c"]
    full = [_step(i, i, i + 0.5) for i in range(3)]
    with pytest.raises(swarm.BenchmarkFailed, match="1 of 3 peers reported nothing"):
        swarm.check_steps("gossip round", {"a": full, "b": full}, peers, 3, allow_alone=True)
    with pytest.raises(swarm.BenchmarkFailed, match="finished 2 of 3 steps"):
        swarm.check_steps("gossip round", {"a": full, "b": full, "c": full[:2]}, peers, 3, allow_alone=True)
    swarm.check_steps("gossip round", {"a": full, "b": full, "c": full}, peers, 3, allow_alone=True)


def test_a_skipped_or_partial_allreduce_step_fails_the_phase(swarm):
    peers = ["a", "b", "c"]
    whole = [_step(i, i, i + 1, group=3) for i in range(2)]
    skipped = [whole[0], _step(1, 1, 2, group=0, skipped=True)]
    with pytest.raises(swarm.BenchmarkFailed, match="skipped step 1"):
        swarm.check_steps("allreduce round", {"a": whole, "b": whole, "c": skipped}, peers, 2, allow_alone=False)
    partial = [whole[0], _step(1, 1, 2, group=2)]
    with pytest.raises(swarm.BenchmarkFailed, match="with 2 of 3 peers"):
        swarm.check_steps("allreduce round", {"a": whole, "b": whole, "c": partial}, peers, 2, allow_alone=False)
    # in gossip a peer averaging alone (its partner was gone) is a finished step
    alone = [whole[0], _step(1, 1, 2, group=1)]
    swarm.check_steps("gossip round", {"a": whole, "b": whole, "c": alone}, peers, 2, allow_alone=True)


def test_round_figures_are_the_median_step_of_the_mean_over_peers(swarm):
    records = {
        "a": [_step(0, 0, 9), _step(1, 10, 11), _step(2, 20, 21), _step(3, 30, 33)],
        "b": [_step(0, 0, 9), _step(1, 10, 13), _step(2, 20, 23), _step(3, 30, 31)],
    }
    seconds, sent = swarm.round_figures(records, warmup=1, steps=3)
    assert seconds == 2.0  # steps 1..3: means 2, 2, 2; the warm-up step (9 s) is left out
    assert sent == 1000


def test_skipped_steps_are_no_progress_in_the_straggler_rate(swarm):
    """An all-reduce that failed (the capped peer did not take part) returns at once: counting
    those steps made the swarm look faster with the straggler than without it."""
    done = [_step(i, i, i + 1.0, group=3) for i in range(6)]
    failed = [_step(i, i, i + 0.2, group=0, skipped=True) for i in range(6)]
    assert swarm.steps_per_minute({"a": done}, ["a"], 0.0, 6.0) == pytest.approx(60.0)
    assert swarm.steps_per_minute({"a": failed}, ["a"], 0.0, 6.0) == 0.0
    mixed = {"a": [*done[:3], _step(3, 3, 3.2, skipped=True)], "b": [_step(0, 0, 1, group=1)]}
    assert swarm.steps_per_minute(mixed, ["a", "b"], 0.0, 6.0) == pytest.approx((3 + 1) / 2 * 10)


def test_consensus_without_every_replica_sampled_fails(swarm):
    records = {"a": [_step(0, 0, 1, sample=[1.0, 2.0])], "b": [_step(0, 0, 1)]}
    with pytest.raises(swarm.BenchmarkFailed, match="sampled by 1 of 2"):
        swarm.consensus_trend(records, 1)
    records = {
        "a": [_step(0, 0, 1, sample=[1.2, 2.0]), _step(1, 1, 2, sample=[1.01, 2.0])],
        "b": [_step(0, 0, 1, sample=[0.8, 2.0]), _step(1, 1, 2, sample=[0.99, 2.0])],
    }
    trend = swarm.consensus_trend(records, 2)
    assert trend["shrinking"]
    assert trend["bounded"]
    assert trend["trend"][0] == pytest.approx(0.2 / 5**0.5, abs=1e-5)


def test_a_survivor_with_no_step_after_the_kill_fails_the_kill_phase(swarm):
    records = {"a": [_step(0, 0, 1), _step(1, 1, 2), _step(2, 2, 8)], "b": [_step(0, 0, 1)]}
    with pytest.raises(swarm.BenchmarkFailed, match="completed no step after the kill"):
        swarm.kill_stall(records, ["a", "b"], 1.5, 9.0)
    assert swarm.kill_stall(records, ["a"], 1.5, 9.0) == pytest.approx(6.0)
    # the step a peer was in when the window closed counts whole (8 -> 15), not cut at the end
    late = {"a": [*records["a"], _step(3, 8, 15)]}
    assert swarm.kill_stall(late, ["a"], 1.5, 9.0) == pytest.approx(7.0)
    assert swarm.paused_peers({**late, "b": records["a"]}, ["a", "b"], 1.5, 9.0, 6.5) == 1
    # a first step only after the window closed is no step after the kill
    with pytest.raises(swarm.BenchmarkFailed, match="completed no step after the kill"):
        swarm.kill_stall({"a": [_step(0, 0, 10)]}, ["a"], 1.5, 9.0)


def test_kill_pauses_are_told_apart_by_the_group_drawn_with_a_dead_peer(swarm):
    """The dead peer's partners may pause up to the grace; a pause of anyone else is reported
    as outside (the benchmark must show that no peer outside the dead peer's group paused)."""

    def steps(*spans):
        return [{**_step(i, t0, t1), "drawn": drawn, "handshake_s": (t1 - t0) / 2}
                for i, (t0, t1, drawn) in enumerate(spans)]

    records = {
        # drawn with the victim "v" (killed at 2.5) at the step ending at 9: its partner
        "a": steps((0, 1, ["a", "v"]), (1, 2, ["a", "b"]), (2, 9, ["a", "v"]), (9, 10, ["a", "b"])),
        # outside: never drawn with "v" after its death, but one long interval (2 -> 8)
        "b": steps((0, 1, ["b", "c"]), (1, 2, ["a", "b"]), (2, 8, ["b", "c"]), (8, 9, ["b", "v"])),
        # drawn with "v" only before it died: that step is outside
        "c": steps((0, 1, ["c", "v"]), (1, 2, ["b", "c"]), (2, 3, ["b", "c"])),
    }
    split = swarm.kill_groups(records, ["a", "b", "c"], [(2.5, "v")], 2.5)
    # intervals counted from the kill at the earliest, as kill_stall counts them
    assert sorted(split["dead_group"]) == [("a", 6.5, 3.5), ("b", 1, 0.5)]
    assert sorted(split["outside"]) == [("a", 1, 0.5), ("b", 5.5, 3.0), ("c", 0.5, 0.5)]
    # a step before the kill is neither; a step that did not say its drawn group fails the phase
    assert swarm.kill_groups(records, ["a"], [(2.5, "v")], 20.0) == {"dead_group": [], "outside": []}
    bare = {"a": [_step(0, 0, 1), _step(1, 1, 3)]}
    with pytest.raises(swarm.BenchmarkFailed, match="did not report the group drawn"):
        swarm.kill_groups(bare, ["a"], [(2.5, "v")], 2.5)


def test_without_root_the_run_exits_with_its_reason():
    argv = [sys.executable, str(SCRIPT), "--sizes", "4", "--steps", "2"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is missing: cannot drop root for this run")
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        probe = subprocess.run(
            [*drop, sys.executable, "-c", f"open({str(SCRIPT)!r}).close()"],
            capture_output=True, text=True, timeout=30, cwd="/",
        )
        if probe.returncode != 0:  # e.g. a checkout under a 0700 directory
            pytest.skip(f"an unprivileged user cannot run this checkout: {probe.stderr.strip()[-200:]}")
        argv = [*drop, *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("swarm_scale needs the WAN lab (run as root)"), proc.stderr
    assert proc.stdout == ""


@pytest.mark.netns
def test_smallest_configuration_runs_on_real_hosts_over_wan_sites():
    reason = wan_unavailable_reason()
    if reason:
        pytest.skip(f"WAN lab unavailable: {reason}")
    argv = [sys.executable, str(SCRIPT), "--sizes", "4", "--steps", "2", "--warmup", "1",
            "--payload-mib", "0.25", "--compute-s", "0.3", "--sites", "2", "--phases", "round"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sizes"] == [4]
    assert result["allreduce_round_s"][0] > 0
    assert result["gossip_round_s"][0] > 0
    numel = int(0.25 * 2**20) // 4
    # all-reduce: each peer sends 2(N-1)/N of its pseudo-gradient; gossip: [φ, Δ] to one partner
    assert result["allreduce_bytes_per_peer"][0] >= 1.5 * numel * 4 * 0.95
    assert result["gossip_bytes_per_peer"][0] >= 2 * numel * 4
    assert result["consensus_distance"]["steps"] == 3
    # replicas start 10 % apart, then average (with overlap the first step lands nothing yet)
    trend = result["consensus_distance"]["trend"]
    assert trend[-1] < trend[0] < 0.11
    assert result["straggler_rate_gossip"] is None
    assert result["kill_any_stall_s"] is None
    assert result["round_steps"] == 2  # --round-steps (5) is at most --steps
    assert 0 <= result["gossip_alone_share"][0] <= 1
    assert result["allreduce_libp2p_bytes"] == [0]  # every pair on its fast channel
    (wire,) = result["links"].values()  # two sites: one delay line, its counters over the run
    assert wire["gbytes"] > 0
    assert wire["dropped"] == 0  # no rate cap: nothing to drop


@pytest.mark.parametrize("bad", [["--round-steps", "1"], ["--exchange-timeout-s", "0"], ["--sizes", "4,x"]])
def test_bad_options_exit_with_a_usage_error(bad):
    proc = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "error:" in proc.stderr
    assert proc.stdout == ""
