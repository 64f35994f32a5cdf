"""When known peers are dialed again (pure, a fake clock)."""

from __future__ import annotations

import pytest

from lattica.net.redial import RedialPolicy, RedialSchedule


def _dial_times(schedule: RedialSchedule, peer: str, *, left: bool, until: float) -> list[float]:
    times, now = [], 0.0
    while now <= until:
        if schedule.due(peer, now=now, left=left):
            times.append(now)
        now = round(now + 0.5, 1)
    return times


def test_a_lost_peer_is_dialed_at_once_then_with_doubling_pauses() -> None:
    schedule = RedialSchedule(RedialPolicy(first_pause_s=1.0, max_pause_s=8.0))
    assert _dial_times(schedule, "p", left=False, until=40) == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]


def test_a_peer_that_said_goodbye_is_redialed_too_but_slower() -> None:
    schedule = RedialSchedule(RedialPolicy(left_first_pause_s=5.0, left_max_pause_s=20.0))
    assert _dial_times(schedule, "p", left=True, until=100) == [5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0]


def test_a_reconnected_peer_starts_afresh_and_non_candidates_are_dropped() -> None:
    schedule = RedialSchedule(RedialPolicy())
    assert schedule.due("p", now=0.0, left=False)
    assert not schedule.due("p", now=0.5, left=False)
    schedule.forget("p")  # connected again
    assert schedule.due("p", now=0.6, left=False)
    schedule.keep_only(set())
    assert schedule.due("p", now=0.7, left=False)


@pytest.mark.parametrize("bad", [{"first_pause_s": 0}, {"first_pause_s": 5, "max_pause_s": 1},
                                 {"left_first_pause_s": -1}, {"left_first_pause_s": 9, "left_max_pause_s": 8}])
def test_policy_is_validated(bad: dict) -> None:
    with pytest.raises(ValueError, match="RedialPolicy"):
        RedialPolicy(**bad)
