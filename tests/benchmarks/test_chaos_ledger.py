"""``benchmarks/chaos_ledger.py`` puts every uncounted member slot of a kept chaos run in one bucket."""

from lattica_lab.benchmark_scripts import load


def _done(t: str, rnd: int, k: int) -> str:
    return f"12:00:{t} INFO lattica.train.service: sync round/{rnd} done with {k} member(s) in 0.1 s\n"


def test_a_kill_and_a_cut_are_split_into_their_buckets(tmp_path, capsys) -> None:
    ledger = load("chaos_ledger")
    # n1 is killed at 12:00:01.5 and resumes at 03.5; n2 is cut at 00.5 and healed at 02.5; both
    # are counted again from round 4 (04.0); n0 runs rounds 2 and 3 alone.
    output = tmp_path / "out.txt"
    output.write_text(
        "12:00:00 +   0.5s cut n2 (round 1)\n"
        "12:00:01 +   1.5s kill n1 (round 2)\n"
        "12:00:02 +   2.5s heal n2\n"
    )
    logs = {
        "n0": [_done("00.000", 0, 3), _done("01.000", 1, 2), _done("02.000", 2, 1), _done("03.600", 3, 1),
               _done("04.000", 4, 3), _done("05.000", 5, 2), _done("06.000", 6, 2)],
        "n1": [_done("00.000", 0, 3), _done("01.000", 1, 2), "lattica node x is up\n",
               "12:00:03.500 INFO lattica.train.engine.trainer: resumed at step 30\n", _done("04.000", 4, 3),
               _done("05.000", 5, 2), _done("06.000", 6, 2)],
        "n2": [_done("00.000", 0, 3), _done("04.000", 4, 3), _done("05.100", 5, 1)],
    }
    for name, lines in logs.items():
        (tmp_path / "chaos" / name).mkdir(parents=True)
        (tmp_path / "chaos" / name / "daemon.log").write_text("".join(lines))
    totals = ledger.ledger(output, tmp_path)
    # round 1: n2 cut; round 2: n1 restarting, n2 cut; round 3: n1 resumed, n2 healed; round 5:
    # n2 up, in a group of its own; round 6: n2 up, in no group
    assert totals["counted"] == 3 + 2 + 1 + 1 + 3 + 2 + 2
    assert (totals["cut"], totals["restart"], totals["resumed"], totals["healed"]) == (2, 1, 1, 1)
    assert (totals["split"], totals["absent"]) == (1, 1)
    kill = capsys.readouterr().out.splitlines()[0]
    assert '"restart_rounds": 1' in kill
    assert '"resumed_rounds": 1' in kill
