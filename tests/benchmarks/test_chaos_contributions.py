"""``benchmarks/chaos.py`` counts the members each round averaged, from the daemons' logs."""

from lattica_lab.benchmark_scripts import load


def test_contributions_sum_each_rounds_members_once(tmp_path) -> None:
    chaos = load("chaos")
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    (tmp_path / "n0" / "daemon.log").write_text(
        "12:00:00.000 INFO lattica.train.service: sync round/0 done with 2 member(s) in 0.1 s\n"
        "12:00:01.000 INFO lattica.train.service: sync round/1 done with 2 member(s) in 0.1 s\n"
    )
    (tmp_path / "n1" / "daemon.log").write_text(
        "12:00:00.000 INFO lattica.train.service: sync round/0 done with 2 member(s) in 0.1 s\n"
        "lattica node 12D3KooW is up\n"
        "12:00:02.000 INFO lattica.train.service: sync round/2 done with 1 member(s) in 0.1 s\n"
    )
    assert chaos.contributions(tmp_path) == 5


def test_restart_to_contribution_is_the_first_averaged_round_after_each_kill(tmp_path) -> None:
    import calendar
    import time

    chaos = load("chaos")
    (tmp_path / "n0").mkdir()
    (tmp_path / "n0" / "daemon.log").write_text(
        "12:00:00.000 INFO lattica.train.service: sync round/0 done with 2 member(s) in 0.1 s\n"
        "12:00:12.000 INFO lattica.train.service: sync round/5 done with 1 member(s) in 0.1 s\n"  # alone: not yet
        "12:00:14.500 INFO lattica.train.service: sync round/6 done with 3 member(s) in 0.1 s\n"
        "12:00:15.000 INFO lattica.train.service: sync round/7 done with 3 member(s) in 0.1 s\n"
        "12:01:10.000 INFO lattica.train.service: sync round/40 done with 2 member(s) in 0.1 s\n"
    )
    noon = calendar.timegm(time.strptime("2026-12-05 12:00:00", "%Y-%m-%d %H:%M:%S"))
    offset = time.localtime(noon).tm_gmtoff  # the logs and the benchmark speak local time
    at = noon - offset
    # killed at 12:00:02 (back at 12:00:14.5), at 12:00:30 and again at 12:00:50 before it
    # averaged anything (left out), then back at 12:01:10
    kills = [(0, at + 2.0), (0, at + 30.0), (0, at + 50.0)]
    assert chaos.restart_to_contribution(tmp_path, kills) == [12.5, 20.0]
    assert chaos._restart_figures([12.5, 20.0, 30.0]) == {"restart_to_contribution_s": 20.0, "restarts_measured": 3}
    assert chaos._restart_figures([]) == {"restart_to_contribution_s": None, "restarts_measured": 0}
