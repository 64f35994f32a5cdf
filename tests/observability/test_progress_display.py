"""ProgressDisplay in terminal and plain-log modes, and the summary table."""

from __future__ import annotations

import io
import re

from lattica.cli.progress import ProgressDisplay, format_bytes, render_summary

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_tty_prints_one_line_per_round_change_and_throttles():
    out, clock = io.StringIO(), FakeClock()
    display = ProgressDisplay(stream=out, clock=clock)
    assert not display.is_tty

    display.update("node-a", round=1, loss=2.5, tokens_per_s=1500.0, peers=2, bytes_sent=3 << 20)
    clock.now = 1.0
    display.update("node-a", loss=2.4)  # same round, within the log interval: no line
    clock.now = 2.0
    display.update("node-a", round=2, loss=2.3)
    clock.now = 30.0
    display.update("node-a", peers=3)  # same round, log interval elapsed: a line
    display.close()

    lines = out.getvalue().splitlines()
    assert lines == [
        "[node-a] round=1 step=- phase=- loss=2.5000 tokens_per_s=1,500.0 peers=2 bytes_sent=3.0MiB "
        "bytes_received=-",
        "[node-a] round=2 step=- phase=- loss=2.3000 tokens_per_s=1,500.0 peers=2 bytes_sent=3.0MiB "
        "bytes_received=-",
        "[node-a] round=2 step=- phase=- loss=2.3000 tokens_per_s=1,500.0 peers=3 bytes_sent=3.0MiB "
        "bytes_received=-",
    ]
    assert not ANSI.search(out.getvalue())


def test_non_tty_never_prints_the_same_line_twice():
    out, clock = io.StringIO(), FakeClock()
    display = ProgressDisplay(stream=out, clock=clock)
    display.update("node-a", round=1, loss=2.5, tokens_per_s=1500.0, peers=1, bytes_sent=10, bytes_received=20)
    for second in range(1, 60):  # a long round, polled every second: nothing new to say
        clock.now = float(second)
        display.update("node-a", round=1, loss=2.5, peers=1, bytes_sent=10, bytes_received=20)
    for second in range(60, 120):  # only the throughput moves
        clock.now = float(second)
        display.update("node-a", tokens_per_s=1500.0 + second)
    clock.now = 121.0
    display.update("node-a", bytes_received=4096)  # something changed: one line
    clock.now = 122.0
    display.update("node-a", round=2)  # a new round: a line at once
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 2)[1] for line in lines] == ["round=1", "round=1", "round=2"]
    assert lines[1].endswith("bytes_received=4.0KiB")
    assert len(set(lines)) == len(lines)


def test_non_tty_prints_a_phase_change_at_once_and_the_step_with_the_throttle():
    out, clock = io.StringIO(), FakeClock()
    display = ProgressDisplay(stream=out, clock=clock)
    display.update("node-a", round=0, phase="waiting for peers to load")
    clock.now = 1.0
    display.update("node-a", phase="training")  # a new phase: a line at once
    clock.now = 2.0
    display.update("node-a", step=10, loss=3.5)  # an inner step within the log interval: no line
    clock.now = 12.0
    display.update("node-a", step=20, loss=3.1)  # the interval has passed: a line
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[1:4] for line in lines] == [
        ["round=0", "step=-", "phase=waiting_for_peers_to_load"],  # a key=value line has no spaces
        ["round=0", "step=-", "phase=training"],
        ["round=0", "step=20", "phase=training"],
    ]
    assert lines[-1].split(" ")[4] == "loss=3.1000"


def test_fields_persist_per_node():
    display = ProgressDisplay(stream=io.StringIO())
    display.update("a", round=3, peers=1)
    display.update("b", round=1)
    display.update("a", loss=1.25)
    snapshot = display.snapshot()
    assert (snapshot["a"].round, snapshot["a"].peers, snapshot["a"].loss) == (3, 1, 1.25)
    assert snapshot["b"].round == 1
    assert snapshot["b"].loss is None


def test_tty_draws_a_live_table_in_place():
    out, clock = TtyStringIO(), FakeClock()
    with ProgressDisplay(stream=out, clock=clock) as display:
        assert display.is_tty
        display.update("node-a", round=4, phase="training", loss=1.5, peers=2, bytes_received=2048)
        clock.now = 1.0
        display.update("node-b", round=4, tokens_per_s=900.0)
    text = out.getvalue()
    assert ANSI.search(text), "a terminal gets cursor-control / style codes"
    plain = ANSI.sub("", text)
    assert "node-a" in plain
    assert "node-b" in plain
    assert "training" in plain  # the phase, as the daemon says it
    assert "1.5000" in plain
    assert "2.0KiB" in plain
    assert "900.0" in plain
    assert "[node-a]" not in plain, "no plain log lines on a terminal"


def test_tty_shows_the_step_while_training_and_else_the_phase_in_a_word():
    out = TtyStringIO()
    with ProgressDisplay(stream=out) as display:
        display.update("node-a", round=0, phase="waiting for peers to load")
        display.update("node-b", round=1, step=60, phase="training")
    rows = [line for line in ANSI.sub("", out.getvalue()).splitlines() if "node-" in line][-2:]
    assert [row.split("│")[3].strip() for row in rows] == ["waiting", "60"]
    assert all(len(row) <= 80 for row in rows)  # an 80-column terminal holds the whole table


def test_tty_redraws_are_rate_limited():
    out, clock = TtyStringIO(), FakeClock()
    display = ProgressDisplay(stream=out, clock=clock)
    display.update("n", round=1)
    size_after_first = len(out.getvalue())
    for step in range(50):
        display.update("n", loss=float(step))  # same instant: no redraw
    assert len(out.getvalue()) == size_after_first
    display.close()  # the final state is always drawn
    assert "49.0000" in ANSI.sub("", out.getvalue())


def test_is_tty_can_be_forced():
    out = io.StringIO()
    display = ProgressDisplay(is_tty=True, stream=out)
    display.update("n", round=1)
    display.close()
    assert ANSI.search(out.getvalue())


def test_render_summary_is_plain_text_table():
    text = render_summary(
        {
            "bootstrap": {"round": 10, "loss": 1.2345678, "bytes_sent": 5 * 1024**3},
            "peer-1": {"round": 9, "loss": None},
        },
        title="Demo",
    )
    assert not ANSI.search(text)
    assert "Demo" in text
    bootstrap_line = next(line for line in text.splitlines() if "bootstrap" in line)
    assert "10" in bootstrap_line
    assert "1.2346" in bootstrap_line
    assert "5.0GiB" in bootstrap_line
    peer_line = next(line for line in text.splitlines() if "peer-1" in line)
    assert "9" in peer_line
    assert "-" in peer_line


def test_format_bytes():
    assert format_bytes(0) == "0B"
    assert format_bytes(1023) == "1023B"
    assert format_bytes(1536) == "1.5KiB"
    assert format_bytes(3 * 1024**4) == "3.0TiB"
    assert format_bytes(5000 * 1024**4) == "5000.0TiB"
