"""``lattica demo``'s workload and processes: the default run is short (a newcomer's first
command), ``--long`` and ``--rounds`` train more, each daemon trains on its share of the cores,
and the swarm is stopped side by side. Timing is measured by ``benchmarks/demo_time.py``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

from lattica.cli import demo
from lattica.cli.main import build_parser
from lattica.config import DEFAULT_INNER_STEPS, DEMO_LONG_ROUNDS, DEMO_ROUNDS
from lattica.errors import ConfigError


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *argv])


def test_the_default_demo_is_four_nodes_training_three_rounds_of_the_default_h():
    args = _parse()
    assert (args.nodes, demo.demo_rounds(args), args.inner_steps) == (4, 3, DEFAULT_INNER_STEPS)
    assert DEMO_ROUNDS == 3
    train = demo._train_args(args, demo.demo_rounds(args))
    assert train[train.index("--rounds") + 1] == "3"
    assert train[train.index("--inner-steps") + 1] == str(DEFAULT_INNER_STEPS)
    assert train[train.index("--min-peers") + 1] == "4"  # the first round is everyone's


def test_long_trains_the_long_workload_and_rounds_always_wins():
    assert demo.demo_rounds(_parse("--long")) == DEMO_LONG_ROUNDS > DEMO_ROUNDS
    assert demo.demo_rounds(_parse("--rounds", "7")) == 7
    assert demo.demo_rounds(_parse("--long", "--rounds", "2")) == 2


def test_zero_rounds_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="--rounds and --inner-steps must be positive"):
        demo.run_demo(_parse("--rounds", "0"))


@pytest.mark.parametrize(("cores", "nodes", "threads"), [(2, 4, 1), (2, 1, 2), (16, 4, 4), (6, 4, 1), (1, 16, 1)])
def test_each_daemon_gets_its_share_of_the_cores(monkeypatch, cores, nodes, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert demo.threads_per_node(nodes) == threads


def test_the_threads_reach_the_daemon_unless_the_user_chose(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = demo.DaemonProcess(tmp_path, torch_threads=1).environment()
    assert env is not None
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is kept
    assert demo.DaemonProcess(tmp_path).environment() is None  # no share: torch's own default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert demo.DaemonProcess(tmp_path, torch_threads=1).environment() is None  # the user's 3 stays


def test_the_demo_swarm_runs_each_daemon_on_its_share_of_the_cores(monkeypatch, tmp_path):
    """Real ``lattica join --train`` processes, as ``lattica demo`` starts them: their
    environment carries the thread share, their flags the workload."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = argparse.Namespace(
        nodes=2, rounds=None, long=False, inner_steps=5, strategy="diloco", model="tiny", base_port=0, json=True,
    )
    daemons = demo._start_swarm(args, tmp_path, rounds=demo.demo_rounds(args))
    try:
        for d in daemons:
            assert d.proc is not None
            environ = Path(f"/proc/{d.proc.pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={demo.threads_per_node(2)}".encode() in environ
            command = d.command()
            assert command[command.index("--rounds") + 1] == str(DEMO_ROUNDS)
    finally:
        demo.stop_all(daemons)
    assert all(d.proc is not None and d.proc.returncode == 0 for d in daemons)


# a process that says when a SIGTERM arrives and takes a while to leave, as a daemon saying
# goodbye does; a second SIGTERM would be written too
_SLOW_LEAVER = """
import signal, sys, time
from pathlib import Path
log = Path(sys.argv[1])
def on_term(signum, frame):
    with log.open("a") as f:
        f.write(f"term {time.monotonic()}\\n")
    time.sleep(1.0)
    with log.open("a") as f:
        f.write(f"exit {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
log.write_text("ready\\n")
while True:
    time.sleep(0.1)
"""


class _SlowLeaver(demo.DaemonProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _SLOW_LEAVER, str(self.log_path)]


def test_stop_all_asks_every_daemon_before_waiting_for_any_and_signals_each_once(tmp_path):
    daemons = [_SlowLeaver(tmp_path / f"n{i}").start() for i in range(3)]
    deadline = time.monotonic() + 30
    while not all(d.log().startswith("ready") for d in daemons):
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.05)
    demo.stop_all(daemons)
    events = [[line.split() for line in d.log().splitlines()[1:]] for d in daemons]
    assert [[kind for kind, _ in e] for e in events] == [["term", "exit"]] * 3  # one SIGTERM each, clean exit
    first_exit = min(float(e[1][1]) for e in events)
    assert all(float(e[0][1]) < first_exit for e in events)  # all were asked before any had left
    assert [d.proc.returncode for d in daemons if d.proc is not None] == [0, 0, 0]
