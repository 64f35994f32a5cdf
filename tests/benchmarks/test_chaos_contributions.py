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
