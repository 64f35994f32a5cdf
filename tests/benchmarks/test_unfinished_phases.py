"""The benchmarks' rule: a phase that did not finish fails the run and never reports a number.

Each benchmark summarizes its phases in a pure function; these tests feed it what an unfinished
phase leaves behind (a replica still training, a missing rep, a skipped sync, a crashed
scenario) and check that it raises instead of returning figures — and that finished phases
still give the figures.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from lattica.train.engine.reports import TrainingSummary
from lattica.train.strategies import STRATEGIES
from lattica_lab import convergence_workers
from lattica_lab.benchmark_scripts import load

# ---------------------------------------------------------------------------- chaos


def test_chaos_undisturbed_phase_that_did_not_finish_has_no_loss():
    chaos = load("chaos")
    infos = [
        {"phase": "done", "round": 240, "rounds_completed": 235, "val_loss": 2.5},
        {"phase": "training", "round": 97, "rounds_completed": 90, "val_loss": None},
        {},  # a daemon that did not answer
    ]
    with pytest.raises(chaos.PhaseUnfinished, match=r"undisturbed phase did not finish: n1 \(training, round 97\), n2"):
        chaos.finished_loss("undisturbed", infos)


def test_chaos_phase_without_a_loss_or_with_a_non_finite_one_fails():
    chaos = load("chaos")
    with pytest.raises(chaos.PhaseUnfinished, match="n0"):
        chaos.finished_loss("chaos", [{"phase": "done", "val_loss": None}])
    with pytest.raises(chaos.PhaseUnfinished, match="n0"):
        chaos.finished_loss("chaos", [{"phase": "done", "val_loss": math.nan}])
    with pytest.raises(chaos.PhaseUnfinished, match="no replica"):
        chaos.finished_loss("chaos", [])


def test_chaos_finished_phase_gives_the_mean_loss():
    chaos = load("chaos")
    infos = [{"phase": "done", "val_loss": 2.0}, {"phase": "done", "val_loss": 3.0}]
    assert chaos.finished_loss("chaos", infos) == pytest.approx(2.5)


def _watched(chaos, stuck_s: float = 60.0):
    """A chaos watch over 2 replicas and its swarm (only what ``watch`` reads of it)."""
    swarm = argparse.Namespace(deadline_s=5.0, rounds=240, inner_steps=1)  # a step a round: step = round
    watch = chaos._Chaos(newest=1, last_advance=0.0)

    def poll(now: float, *infos: dict) -> None:
        watch.watch(swarm, list(infos), now, stuck_s)

    return watch, poll


def test_chaos_counts_the_round_reached_adopted_rounds_included():
    chaos = load("chaos")
    watch, poll = _watched(chaos)
    watch.resuming[1] = (120, 0.0)  # killed at round 120
    poll(0.5, {"phase": "training", "step": 125}, {"phase": "training"})  # no progress reported yet
    assert watch.lost == 0
    assert 1 not in watch.resuming  # may be disturbed again, its loss is measured later
    # it adopted round 130: its step says so, its count of rounds it ran does not
    poll(1.0, {"phase": "training", "step": 130}, {"phase": "training", "step": 130, "rounds_completed": 30})
    assert watch.newest == 130
    assert watch.lost == 0  # it adopted the swarm's round: nothing lost


def test_chaos_fails_at_once_naming_a_replica_that_stopped_progressing():
    chaos = load("chaos")
    _, poll = _watched(chaos)
    stuck = {"phase": "waiting for peers", "step": 0}
    for second in range(0, 61, 5):
        poll(float(second), {"phase": "training", "step": 10 + second}, stuck)
    with pytest.raises(chaos.PhaseUnfinished, match=r"n1 stopped progressing: at round 0 \(phase waiting for peers\)"):
        poll(61.0, {"phase": "training", "step": 72}, stuck)


def test_chaos_fails_naming_a_restarted_replica_that_never_trains_again():
    chaos = load("chaos")
    watch, poll = _watched(chaos)
    watch.resuming[0] = (50, 0.0)
    poll(30.0, {"phase": "loading", "step": 0}, {"phase": "training", "step": 60})
    with pytest.raises(chaos.PhaseUnfinished, match=r"n0 is not training 61 s after its restart"):
        poll(61.0, {"phase": "waiting for peers", "step": 0}, {"phase": "training", "step": 90})


def test_chaos_does_not_blame_a_replica_that_is_cut_off_done_or_waiting_for_a_stalled_swarm():
    chaos = load("chaos")
    watch, poll = _watched(chaos)
    watch.cut = (1, 100.0)
    for second in range(0, 100, 5):  # cut off: its round stays, the others move on
        poll(float(second), {"phase": "training", "step": 10 + second}, {"phase": "training", "step": 9})
    watch.cut = None
    poll(100.0, {"phase": "training", "step": 110}, {"phase": "training", "step": 9})  # healed: watched afresh
    poll(150.0, {"phase": "training", "step": 110}, {"phase": "training", "step": 110})
    poll(215.0, {"phase": "done", "step": 240}, {"phase": "done", "step": 240})
    poll(400.0, {"phase": "done", "step": 240}, {"phase": "done", "step": 240})


# ---------------------------------------------------------------------------- overlap


def _overlap_args(strategies=("nocomm", "diloco", "eager", "streaming")) -> argparse.Namespace:
    return argparse.Namespace(
        strategies=list(strategies), steps=120, inner_steps=40, overlap_steps=5, rate_mbit=20.0,
        cycles=1, workers=4,
    )


def _overlap_row(wall: float, syncs: int, **changes) -> dict:
    row = {
        "ok": True, "steps": 120, "syncs": syncs, "skipped_syncs": 0, "inner_s": wall * 0.9,
        "wall_s": wall, "util": 0.9, "bytes_sent": 1000, "step_s": wall * 0.9 / 120,
        "step_cpu_s": 0.02, "other_cpu_s": 0.1, "step_waits": 0.5, "comm_s": 0.3,
    }
    return row | changes


def _overlap_results(**overrides) -> dict[str, list[dict]]:
    args = _overlap_args()
    overlap = load("overlap")
    walls = {"nocomm": 20.0, "diloco": 25.0, "eager": 21.0, "streaming": 22.0}
    results = {
        name: [_overlap_row(walls[name], overlap.expected_syncs(name, args)) for _ in range(4)]
        for name in walls
    }
    return results | overrides


def test_overlap_reports_utilization_against_no_communication_and_blocking():
    overlap = load("overlap")
    out = overlap.summarize(_overlap_results(), _overlap_args())
    assert out["eager_util_vs_nocomm"] == pytest.approx(20.0 / 21.0, abs=1e-4)
    assert out["streaming_util_vs_nocomm"] == pytest.approx(20.0 / 22.0, abs=1e-4)
    assert out["blocking_util_vs_nocomm"] == pytest.approx(20.0 / 25.0, abs=1e-4)
    assert out["eager_speedup_vs_blocking"] == pytest.approx(25.0 / 21.0, abs=1e-4)
    assert out["streaming_speedup_vs_blocking"] == pytest.approx(25.0 / 22.0, abs=1e-4)
    assert out["eager_util"] == pytest.approx(0.9)  # the per-strategy figure stays


def test_overlap_streaming_expects_every_fragment_sync_started():
    overlap = load("overlap")
    # fragment 0 starts at 40, 80, 120; fragment 1 (offset H/2) at 60, 100 — never before H
    assert overlap.expected_syncs("streaming", _overlap_args()) == 5
    assert overlap.expected_syncs("eager", _overlap_args()) == 3
    assert overlap.expected_syncs("nocomm", _overlap_args()) == 0


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        ({"ok": False, "error": "trained 80 of 120 steps"}, "peer 2 did not finish"),
        ({"steps": 80}, "peer 2 trained 80 of 120 steps"),
        ({"skipped_syncs": 1}, "peer 2 skipped 1 sync"),
        ({"syncs": 1}, "peer 2 completed 1 of 3 syncs"),
        ({"wall_s": 0.0}, "peer 2 reported no wall time"),
    ],
)
def test_overlap_unfinished_phase_fails_the_run(broken: dict, match: str):
    overlap = load("overlap")
    rows = [_overlap_row(21.0, 3) for _ in range(4)]
    rows[2] = rows[2] | broken
    with pytest.raises(overlap.BenchmarkFailed, match=match):
        overlap.summarize(_overlap_results(eager=rows), _overlap_args())


def test_overlap_missing_phase_or_peer_fails_the_run():
    overlap = load("overlap")
    results = _overlap_results()
    del results["streaming"]
    with pytest.raises(overlap.BenchmarkFailed, match="streaming"):
        overlap.summarize(results, _overlap_args())
    results = _overlap_results()
    results["eager"] = results["eager"][:3]
    with pytest.raises(overlap.BenchmarkFailed, match="eager"):
        overlap.summarize(results, _overlap_args())


# ---------------------------------------------------------------------------- transfer


def test_transfer_missing_rep_fails_and_complete_reps_give_ratios():
    transfer = load("transfer")
    mib = 1 << 20
    reps = {"tcp": [(0.1, 0.05)] * 2, "fast": [(0.2, 0.1)] * 2, "libp2p": [(1.0, 0.9)] * 2}
    out = transfer.summarize(256 * mib, reps, 2)
    assert out["fast_vs_tcp"] == pytest.approx(0.5)
    assert out["libp2p_vs_tcp"] == pytest.approx(0.1)
    assert out["fast_vs_tcp_cpu"] == pytest.approx(0.5)
    assert set(out) >= {"tcp_mb_s", "fast_mb_s", "libp2p_mb_s", "fast_vs_tcp", "libp2p_vs_tcp"}
    with pytest.raises(transfer.BenchmarkFailed, match="fast: 1 of 2 reps"):
        transfer.summarize(256 * mib, reps | {"fast": [(0.2, 0.1)]}, 2)
    with pytest.raises(transfer.BenchmarkFailed, match="libp2p: 0 of 2 reps"):
        transfer.summarize(256 * mib, {k: v for k, v in reps.items() if k != "libp2p"}, 2)


# ---------------------------------------------------------------------------- convergence


def test_convergence_all_covers_every_registered_strategy():
    convergence = load("convergence")
    methods = convergence.all_methods()
    assert set(STRATEGIES) <= set(methods)
    assert {m.strategy for m in methods.values()} == set(STRATEGIES)
    assert set(convergence.METHODS) <= set(methods)  # the extras (moe_diloco) stay


def _summary(steps: int, val_loss: float | None) -> TrainingSummary:
    return TrainingSummary(
        steps=steps, rounds=1, train_loss=3.0, val_loss=val_loss, tokens=1, seconds=1.0, bytes_sent=0
    )


def test_convergence_method_that_did_not_finish_fails():
    done = {i: _summary(100, 2.5) for i in range(convergence_workers.WORKERS)}
    assert convergence_workers.finished_losses("diloco", done, 100) == [2.5] * convergence_workers.WORKERS
    with pytest.raises(convergence_workers.BenchmarkFailed, match="worker 1 trained 50 of 100"):
        convergence_workers.finished_losses("diloco", done | {1: _summary(50, 2.5)}, 100)
    with pytest.raises(convergence_workers.BenchmarkFailed, match="worker 2 ended with validation loss nan"):
        convergence_workers.finished_losses("eager", done | {2: _summary(100, math.nan)}, 100)
    with pytest.raises(convergence_workers.BenchmarkFailed, match="worker 3 did not report"):
        convergence_workers.finished_losses("eager", {i: done[i] for i in range(3)}, 100)


def test_convergence_rejects_an_unknown_strategy(capsys):
    convergence = load("convergence")
    assert convergence.main(["--strategies", "nosuch"]) == 2
    assert "unknown strategies ['nosuch']" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the others


def test_allreduce_member_that_did_not_finish_fails():
    allreduce = load("allreduce")
    allreduce.check_replies("lattica", [{"ok": True, "seconds": 0.3}] * 4, 4)
    with pytest.raises(allreduce.BenchmarkFailed, match="member 1 did not finish"):
        allreduce.check_replies("lattica", [{"ok": True, "seconds": 0.3}, {"ok": False, "error": "deadline"}], 2)
    with pytest.raises(allreduce.BenchmarkFailed, match="3 of 4 members"):
        allreduce.check_replies("gloo", [{"seconds": 0.2}] * 3, 4)


def test_nat_matrix_scenario_that_raised_has_no_summary():
    nat_matrix = load("nat_matrix")
    from lattica_lab.netlab import ScenarioResult

    fine = ScenarioResult("public<->public", direct_possible=True, connected=True, path="direct",
                          connect_s=1.0, direct_s=1.0)
    broken = ScenarioResult("nat<->nat", direct_possible=True)
    broken.details["error"] = "RuntimeError('lab broke')"
    assert nat_matrix.summarize([fine])["max_connect_s"] == 1.0
    with pytest.raises(nat_matrix.ScenarioUnfinished, match=r"nat<->nat \(RuntimeError"):
        nat_matrix.summarize([fine, broken])


def test_dht_scale_failed_join_fails_the_growth_step():
    dht_scale = load("dht_scale")
    dht_scale.check_grown(50, {0: {"peers": [], "failed_joins": []}, 1: {"peers": []}})
    with pytest.raises(dht_scale.BenchmarkFailed, match="growing to 50 nodes: 2 join"):
        dht_scale.check_grown(50, {0: {"failed_joins": ["join took over 60 s", "x"]}})


def test_overlap_ratios_are_paired_within_a_cycle_and_the_median_over_cycles():
    overlap = load("overlap")
    args = _overlap_args()
    args.cycles = 3
    # the no-communication reference drifts between cycles (14 s in the second, 20 s in the
    # others) and a load spike hits streaming in the third
    walls = {
        "nocomm": (20.0, 14.0, 20.0), "diloco": (25.0, 17.5, 25.0), "eager": (21.0, 15.5, 19.0),
        "streaming": (22.0, 15.0, 40.0),
    }
    results = {
        name: [_overlap_row(w, overlap.expected_syncs(name, args)) for w in cycle for _ in range(4)]
        for name, cycle in walls.items()
    }
    out = overlap.summarize(results, args)
    assert out["nocomm_wall_s"] == 14.0  # a wall is still its best cycle's
    # medians of the per-cycle ratios; the best walls (14 / 15.5 = 0.903, 14 / 15 = 0.933, 17.5 /
    # 15.5 = 1.129) would pair the reference's fastest cycle with another cycle of the strategy
    assert out["eager_util_vs_nocomm"] == pytest.approx(20.0 / 21.0, abs=1e-4)
    assert out["streaming_util_vs_nocomm"] == pytest.approx(20.0 / 22.0, abs=1e-4)
    assert out["blocking_util_vs_nocomm"] == pytest.approx(0.8, abs=1e-4)
    assert out["eager_speedup_vs_blocking"] == pytest.approx(25.0 / 21.0, abs=1e-4)
    assert out["streaming_speedup_vs_blocking"] == pytest.approx(25.0 / 22.0, abs=1e-4)
    line = overlap.cycle_line(results, args, 1)
    assert line.startswith("cycle 2: ")
    assert "eager vs nocomm 0.903" in line
    assert "eager speedup vs blocking 1.129" in line


# ---------------------------------------------------------------------------- demo_time


def _demo_json(**changes: object) -> str:
    done = {"phase": "done", "rounds": 3, "first_loss": 4.7, "val_loss": 2.55}
    result = {"nodes": {"node0": done, "node1": done}, "replicas_identical": True, "ok": True, **changes}
    return "starting ...\n" + json.dumps(result) + "\n"


def test_demo_time_a_demo_that_did_not_finish_has_no_figures():
    demo_time = load("demo_time")
    with pytest.raises(demo_time.PhaseUnfinished, match=r"exited with 1 without its summary: starting \| node0: boom"):
        demo_time.demo_figures(1, "", "starting\nnode0: boom\n")
    with pytest.raises(demo_time.PhaseUnfinished, match="without its summary"):
        demo_time.demo_figures(0, "not json\n", "")
    still_training = {"phase": "training", "rounds": 1}
    with pytest.raises(demo_time.PhaseUnfinished, match="did not finish: node1"):
        demo_time.demo_figures(0, _demo_json(nodes={"node0": {"phase": "done"}, "node1": still_training}), "")
    with pytest.raises(demo_time.PhaseUnfinished, match="none reported"):
        demo_time.demo_figures(0, _demo_json(nodes={}), "")
    with pytest.raises(demo_time.PhaseUnfinished, match="not bit-identical"):
        demo_time.demo_figures(0, _demo_json(replicas_identical=False, ok=False), "")


def test_demo_time_a_finished_demo_gives_its_rows():
    rows = load("demo_time").demo_figures(0, _demo_json(), "")
    assert [row["val_loss"] for row in rows] == [2.55, 2.55]


# ---------------------------------------------------------------------------- autotune


def _autotune_row(**changes):
    return {"ok": True, "steps": 400, "syncs": 8, "skipped_syncs": 0, "wall_s": 30.0, "val_loss": 2.3, **changes}


@pytest.mark.parametrize(("change", "match"), [
    ({"ok": False, "error": "trained 120 of 400 steps"}, "did not finish"),
    ({"steps": 399}, "did not finish"),
    ({"skipped_syncs": 1}, "skipped"),
    ({"syncs": 6}, "6 of 8 syncs"),
    ({"val_loss": math.nan}, "no finite loss"),
    ({"val_loss": None}, "no finite loss"),
])
def test_autotune_unfinished_phase_fails(change, match):
    autotune = load("autotune")
    rows = [_autotune_row(), _autotune_row(), _autotune_row(), _autotune_row(**change)]
    with pytest.raises(autotune.BenchmarkFailed, match=match):
        autotune.check_phase("tuned", rows, 400, {"strategy": "diloco", "inner_steps": 50})


def test_autotune_finished_phases_pass_and_co2_owes_its_last_mean():
    autotune = load("autotune")
    autotune.check_phase("default", [_autotune_row()] * 4, 400, {"strategy": "diloco", "inner_steps": 50})
    autotune.check_phase("tuned", [_autotune_row(syncs=15)] * 4, 400, {"strategy": "co2", "inner_steps": 25})
    with pytest.raises(autotune.BenchmarkFailed, match="3 peer reports"):
        autotune.check_phase("nocomm", [_autotune_row()] * 3, 400, {"strategy": "nocomm", "inner_steps": 1})


def _co2_row(*, clean_step_s: float, later_step_s: float, steps: int = 2000, h: int = 200, payload: int = 748_032):
    return _autotune_row(steps=steps, syncs=steps // h - 1, bytes_sent=steps // h * payload,
                         clean_step_s=clean_step_s, later_step_s=later_step_s)


def test_autotune_overlap_cost_is_measured_against_the_same_phase():
    """A machine loaded more than during an earlier phase slows every step of an overlapped
    phase alike: no cost of the exchange. Only the steps beside an exchange running slower than
    the same phase's steps before its first sync count, over the rounds that ran beside them."""
    autotune = load("autotune")
    phase = {"strategy": "co2", "inner_steps": 200, "codec": "fp32"}
    loaded = [_co2_row(clean_step_s=0.072, later_step_s=0.072)] * 4
    assert autotune._comm_cpu(loaded, phase) == (0.0, 0.0)
    slowed = [_co2_row(clean_step_s=0.030, later_step_s=0.032)] * 4  # 2 ms x 1,800 steps, 9 rounds
    per_byte, per_round = autotune._comm_cpu(slowed, phase)
    assert per_round == pytest.approx(0.4)
    assert per_byte == pytest.approx(3.6 / (9 * 748_032))


def test_autotune_clean_step_is_the_phase_before_its_first_sync():
    autotune = load("autotune")
    timing = {"inner": 10.0 * 0.03 + 30 * 0.04, "first_phase": 10 * 0.03, "clean": 8 * 0.03}
    steps = autotune._phase_steps(timing, 40, 10)
    assert steps == {"clean_step_s": pytest.approx(0.03), "later_step_s": pytest.approx(0.04)}
    assert autotune._phase_steps(timing, 40, 0) == {}  # no communication: no sync to time against
