"""The tuned sync schedule, the run config's tuned entry and the admin's decision (sans-IO)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.settings.autotune import Measurements, tune
from lattica.train.settings.retune import (
    MAX_PERIODS,
    Period,
    PhaseTimer,
    TunedEntry,
    codec_at,
    decide,
    fixed_knobs,
    next_sync_step,
    parse_entry,
    period_at,
    slowest_bandwidth_bps,
    step_and_comm_cpu,
)
from lattica.train.settings.settings_check import check_tune
from lattica.train.swarm.run_config import RUN_WIDE

LINK = Measurements(step_s=0.03, model_bytes=4_000_000, bandwidth_bps=1e9, rtt_s=0.001, peers=3)
ALLREDUCE = fixed_knobs("diloco", "allreduce", 2, False)


def syncs(base: int, periods: tuple[Period, ...], end: int) -> list[int]:
    steps, step = [], 0
    while step < end:
        step = next_sync_step(step, base=base, periods=periods, end=end)
        steps.append(step)
    return steps


def test_without_periods_the_schedule_is_every_h_steps() -> None:
    assert syncs(5, (), 30) == [5, 10, 15, 20, 25, 30]


def test_a_period_starts_at_its_step_and_the_run_ends_with_a_sync() -> None:
    periods = (Period(from_step=10, inner_steps=25), Period(from_step=60, inner_steps=7))
    assert syncs(5, periods, 80) == [5, 10, 35, 60, 67, 74, 80]
    assert period_at(9, base=5, periods=periods) == 5
    assert period_at(10, base=5, periods=periods) == 25
    assert period_at(61, base=5, periods=periods) == 7


def test_a_member_that_learns_of_a_period_late_syncs_where_the_others_do() -> None:
    periods = (Period(from_step=10, inner_steps=25),)
    # it ran on to step 15 with the old schedule (synced at 10 as everybody did)
    assert next_sync_step(15, base=5, periods=periods, end=100) == 35


@pytest.mark.parametrize("raw", [
    "periods", {"periods": "x", "bandwidth_bps": 1.0}, {"periods": [[0, 0]], "bandwidth_bps": 1.0},
    {"periods": [[10, 5], [10, 6]], "bandwidth_bps": 1.0}, {"periods": [[20, 5], [10, 6]], "bandwidth_bps": 1.0},
    {"periods": [[10, True]], "bandwidth_bps": 1.0}, {"periods": [[10, 10**9]], "bandwidth_bps": 1.0},
    {"periods": [[10, 5, 1]], "bandwidth_bps": 1.0}, {"periods": [], "bandwidth_bps": "fast"},
    {"periods": [], "bandwidth_bps": float("inf")}, {"periods": [], "bandwidth_bps": -1},
    {"periods": [[i, 5] for i in range(MAX_PERIODS + 1)], "bandwidth_bps": 1.0},
    {"periods": [], "bandwidth_bps": 1.0, "not_applied": ["x" * 1000]},
    {"periods": [], "bandwidth_bps": 1.0, "comm_cpu_s_per_byte": "slow"},
    {"periods": [[10, 5, "int3"]], "bandwidth_bps": 1.0}, {"periods": [[10, 5, "int8", 1]], "bandwidth_bps": 1.0},
    {"periods": [], "bandwidth_bps": 1.0, "comm_cpu_s_per_byte": -1.0},
    {"periods": [], "bandwidth_bps": 1.0, "comm_cpu_s_per_byte": float("nan")},
])
def test_a_malformed_tuned_entry_is_refused(raw: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each names its own field
        parse_entry(raw)


def test_an_entry_survives_the_run_config_round_trip() -> None:
    entry = TunedEntry(periods=(Period(from_step=10, inner_steps=25),), bandwidth_bps=2e7, not_applied=("codec",))
    assert parse_entry(entry.to_json()) == entry


def test_the_first_tuning_starts_its_period_at_the_next_sync() -> None:
    decision = decide(LINK, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95)
    assert decision is not None
    h = decision.applied.config.inner_steps
    assert decision.entry.periods == (Period(from_step=10, inner_steps=h),)
    assert decision.entry.bandwidth_bps == LINK.bandwidth_bps
    assert "first tuning" in decision.reason


def test_no_period_starts_at_the_runs_last_sync() -> None:
    first = decide(LINK, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95)
    assert first is not None
    much_slower = Measurements(**{**LINK.__dict__, "bandwidth_bps": 2e7})
    assert decide(replace(much_slower, steps_left=5), current=first.entry, fixed=ALLREDUCE, next_sync=95,
                  base=5, target=0.95, min_rounds=0) is not None
    assert decide(replace(much_slower, steps_left=0), current=first.entry, fixed=ALLREDUCE, next_sync=100,
                  base=5, target=0.95, min_rounds=0) is None


def test_no_retune_within_twice_the_bandwidth_and_a_retune_beyond() -> None:
    first = decide(LINK, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95)
    assert first is not None
    slower = Measurements(**{**LINK.__dict__, "bandwidth_bps": LINK.bandwidth_bps / 1.9})
    assert decide(slower, current=first.entry, fixed=ALLREDUCE, next_sync=35, base=5, target=0.95) is None
    much_slower = Measurements(**{**LINK.__dict__, "bandwidth_bps": 2e7})
    again = decide(much_slower, current=first.entry, fixed=ALLREDUCE, next_sync=35, base=5, target=0.95)
    assert again is not None
    assert again.entry.periods[:1] == first.entry.periods
    assert again.entry.periods[-1].from_step == 35
    assert again.entry.periods[-1].inner_steps > first.entry.periods[-1].inner_steps
    assert "more than 2x" in again.reason


def test_what_the_run_cannot_change_is_reported_not_applied() -> None:
    slow = Measurements(step_s=0.03, model_bytes=4_000_000, bandwidth_bps=2e6, rtt_s=0.1, peers=4)
    decision = decide(slow, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95)
    assert decision is not None
    assert decision.applied.config.overlap is False
    assert decision.applied.config.codec == "int4"  # the run's codec is a knob of the tuned periods
    free = decision.free.config
    assert free.overlap or free.codec != "fp32" or free.group_size  # the free search goes further
    changed = [line.split(" =")[0] for line in decision.entry.not_applied]
    for knob in ("overlap", "group_size"):  # held by the run: reported where the free search differs
        assert (knob in changed) == (getattr(free, knob) != getattr(decision.applied.config, knob))
    assert "codec" not in changed  # applied, never reported
    assert "chunk_bytes" in changed


def test_fixed_knobs_hold_the_search() -> None:
    slow = Measurements(step_s=0.03, model_bytes=4_000_000, bandwidth_bps=2e6, rtt_s=0.1, peers=4)
    held = tune(slow, fixed={"codec": "fp32", "overlap": "co2", "group_size": 0})
    assert (held.config.codec, held.config.overlap, held.config.group_size) == ("fp32", "co2", 0)
    with pytest.raises(ValueError, match="codec"):
        tune(slow, fixed={"codec": "int3"})


@pytest.mark.parametrize(("strategy", "averaging", "gossip_overlap", "overlap"), [
    ("co2", "allreduce", False, "co2"), ("eager", "allreduce", False, "eager"),
    ("diloco", "gossip", True, "eager"), ("diloco", "allreduce", False, False),
])
def test_a_running_swarm_holds_its_overlap_method(strategy, averaging, gossip_overlap, overlap) -> None:
    # gossip_overlap lands an exchange a round late from eager's look-ahead: charged as eager
    assert fixed_knobs(strategy, averaging, 2, gossip_overlap)["overlap"] == overlap


def test_the_slowest_timed_peer_sets_the_bandwidth() -> None:
    sent = {"a": (1_000_000, 0.1), "b": (1_000_000, 0.4), "c": (10, 0.0)}
    assert slowest_bandwidth_bps(sent, ["a", "b"]) == pytest.approx(2e7)
    assert slowest_bandwidth_bps(sent, ["c", "d"]) is None


def test_tune_is_a_run_wide_setting_checked_at_start() -> None:
    assert "tune" in RUN_WIDE
    with pytest.raises(ConfigError, match="tune"):
        TrainSettings(tune="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="streaming"):
        check_tune(TrainSettings(strategy="streaming", tune=True))
    check_tune(TrainSettings(strategy="co2", tune=True))


def test_tune_without_all_figures_asks_the_daemon_and_says_when_none_runs(tmp_path, capsys) -> None:
    from lattica.cli.main import main

    assert main(["tune", "--data-dir", str(tmp_path), "--peers", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lattica: error: no daemon running for data dir {tmp_path}"]


def test_a_member_keeps_the_last_valid_schedule_when_the_entry_turns_malformed(caplog) -> None:
    from types import SimpleNamespace

    from lattica.train.tuner import RunTuner

    caplog.set_level("INFO", logger="lattica.train.tuner")
    config: dict[str, object] = {}
    view = SimpleNamespace(peer_id="me", run_config=lambda: config)
    tuner = RunTuner(view, TrainSettings(tune=True), round_trip_times=None, traffic=None)  # type: ignore[arg-type]
    assert tuner.periods() == ()
    config["tuned"] = {"periods": [[10, 25]], "bandwidth_bps": 2e7}
    assert tuner.periods() == (Period(from_step=10, inner_steps=25),)
    assert "the run syncs every 25 steps from step 10" in caplog.text
    config["tuned"] = {"periods": [[10, 25], [5, 400]], "bandwidth_bps": 2e7}
    assert tuner.periods() == (Period(from_step=10, inner_steps=25),)
    assert "tuned entry is refused (periods must have increasing from_step)" in caplog.text


def _timer(*, clean: float, last: float, steps: int, sync_cpu: float) -> PhaseTimer:
    timer = PhaseTimer()
    timer.clean_step_s, timer.step_s, timer.phase_steps, timer.sync_cpu_s = clean, last, steps, sync_cpu
    return timer


def test_an_overlapped_run_measures_the_cpu_by_the_slowdown_of_its_steps() -> None:
    timer = _timer(clean=0.040, last=0.048, steps=50, sync_cpu=0.01)
    step, cpu = step_and_comm_cpu(timer, overlapped=True, bytes_sent=1_000_000)
    assert step == 0.040  # the step with no exchange in flight, not the slowed one
    assert cpu == pytest.approx(4e-7)  # 50 × 8 ms over 1 MB


def test_a_blocking_run_measures_the_cpu_of_its_syncs() -> None:
    timer = _timer(clean=0.040, last=0.045, steps=50, sync_cpu=0.3)
    step, cpu = step_and_comm_cpu(timer, overlapped=False, bytes_sent=750_000)
    assert step == 0.045
    assert cpu == pytest.approx(4e-7)


def test_a_changed_communication_cpu_retunes() -> None:
    first = decide(LINK, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95)
    assert first is not None
    assert first.entry.comm_cpu_s_per_byte == 0.0
    busy = Measurements(**{**LINK.__dict__, "comm_cpu_s_per_byte": 5e-8})
    again = decide(busy, current=first.entry, fixed=ALLREDUCE, next_sync=35, base=5, target=0.95)
    assert again is not None
    assert "communication CPU 50 ns/byte" in again.reason
    assert again.entry.comm_cpu_s_per_byte == 5e-8
    assert parse_entry(again.entry.to_json()) == again.entry
    similar = Measurements(**{**LINK.__dict__, "comm_cpu_s_per_byte": 8e-8})
    assert decide(similar, current=again.entry, fixed=ALLREDUCE, next_sync=60, base=5, target=0.95) is None


def test_the_first_phase_is_timed_from_after_the_warmup_steps() -> None:
    timer = PhaseTimer()
    timer.phase_ended(5)  # not started: nothing timed
    assert timer.step_s is None
    timer.start(2)
    timer.phase_ended(5)
    assert timer.step_s is not None
    assert timer.clean_step_s == timer.step_s
    assert timer.phase_steps == 3


def test_a_tuned_period_carries_the_codec_every_member_sends_with() -> None:
    slow = Measurements(step_s=0.03, model_bytes=4_000_000, bandwidth_bps=2e6, rtt_s=0.1, peers=4)
    decision = decide(slow, current=None, fixed=ALLREDUCE, next_sync=10, base=5, target=0.95, base_codec="fp32")
    assert decision is not None
    period = decision.entry.periods[-1]
    assert (period.from_step, period.codec) == (10, decision.applied.config.codec)
    assert period.codec != "fp32"
    assert parse_entry(decision.entry.to_json()) == decision.entry
    assert codec_at(9, base="fp32", periods=decision.entry.periods) == "fp32"  # the sync at 10 is the old period's
    assert codec_at(10, base="fp32", periods=decision.entry.periods) == period.codec
    # a strategy with a compression of its own: the codec is held and the periods carry none
    sparse = decide(slow, current=None, fixed=fixed_knobs("sparseloco", "allreduce", 2, False), next_sync=10,
                    base=5, target=0.95)
    assert sparse is not None
    assert sparse.applied.config.codec == "fp32"
    assert all(p.codec is None for p in sparse.entry.periods)


def test_a_codec_change_alone_starts_a_period() -> None:
    m = Measurements(step_s=0.03, model_bytes=4_000_000, bandwidth_bps=2e6, rtt_s=0.1, peers=4,
                     comm_cpu_s_per_byte=1e-7)  # tunes to H 400, int4
    entry = TunedEntry(periods=(Period(from_step=10, inner_steps=400, codec="fp32"),), bandwidth_bps=2e6)
    decision = decide(m, current=entry, fixed=ALLREDUCE, next_sync=410, base=5, target=0.95, base_codec="fp32")
    assert decision is not None
    assert decision.entry.periods[1:] == (Period(from_step=410, inner_steps=400, codec="int4"),)
    same = TunedEntry(periods=(Period(from_step=10, inner_steps=400, codec="int4"),), bandwidth_bps=2e6)
    again = decide(m, current=same, fixed=ALLREDUCE, next_sync=410, base=5, target=0.95, base_codec="fp32")
    assert again is not None
    assert again.entry.periods == same.periods  # nothing new to apply: no period


def test_the_daemons_figures_carry_the_steps_the_run_has_left() -> None:
    from lattica.train.tuner import measurements_of

    figures = {"step_s": 0.03, "model_bytes": 500_000, "bandwidth_bps": 20e6, "rtt_s": 0.1, "peers": 4}
    assert measurements_of(figures).steps_left is None
    assert measurements_of({**figures, "steps_left": 400}).steps_left == 400
    for bad in ("400", 2.5, True, -1):
        with pytest.raises(ValueError, match="steps_left"):
            measurements_of({**figures, "steps_left": bad})
