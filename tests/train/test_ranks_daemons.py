"""Nodes of several CPU ranks (``--devices cpu:2``) through real ``lattica join --train``
daemons: one swarm member per node whatever its number of ranks, the same outer weights
everywhere, and a rank killed mid-run restarted without taking the daemon down."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli, wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    killed_at_end,
    log_from,
    sync_members,
    train_args,
    training,
    wait_done,
)

pytestmark = pytest.mark.timeout(240)

RANKS_ENV = {**TRAIN_ENV, "LATTICA_TRAIN_ROUND_DEADLINE_S": "15"}


def _start(base: Path, started: list[DaemonProcess], devices: tuple[str, ...], *, rounds: int,
           inner_steps: int) -> list[DaemonProcess]:
    daemons: list[DaemonProcess] = []
    for i, spec in enumerate(devices):
        args = (*train_args("diloco", rounds=rounds, inner_steps=inner_steps, min_peers=len(devices)),
                "--devices", spec)
        peers = (daemons[0].addr,) if daemons else ()
        daemon = DaemonProcess(base / f"n{i}", peers=peers, extra_args=args, env=RANKS_ENV).start()
        started.append(daemon)
        daemon.wait_ready(60)
        daemons.append(daemon)
    return daemons


# Two nodes of two ranks each agreeing is also what the rank-killed test below ends with (its
# final hashes); this one swarm of a node of two ranks and a node of one shows the rest.
def test_a_node_of_two_ranks_and_a_node_of_one_agree_and_each_is_one_member(tmp_path: Path) -> None:
    with killed_at_end() as started:
        nodes = _start(tmp_path, started, ("cpu:2", "cpu"), rounds=3, inner_steps=6)
        infos = wait_done(nodes, timeout=200)
        assert [i["rounds_completed"] for i in infos] == [3, 3]
        assert len(final_hashes(nodes, rounds=3)) == 1
        assert [d["name"] for d in infos[0]["devices"]] == ["cpu:0", "cpu:1"]
        assert [len(i["devices"]) for i in infos] == [2, 1]
        assert infos[0]["ranks_agree"] is True
        assert infos[0]["rank_restarts"] == 0
        for node in nodes:  # one member per node: every sync has the two nodes, not three ranks
            assert set(sync_members(log_from(node))) == {2}
        assert len(nodes[0].call("state")["members"]) == 2


def test_a_rank_killed_mid_run_is_restarted_and_the_node_rejoins(tmp_path: Path) -> None:
    rounds = 6
    with killed_at_end() as started:
        nodes = _start(tmp_path, started, ("cpu:2", "cpu:2"), rounds=rounds, inner_steps=20)
        victim_node = nodes[1]
        wait_for(lambda: training(victim_node).get("rounds_completed", 0) >= 1
                 and all("pid" in d for d in training(victim_node).get("devices", [])), timeout=120)
        before = training(victim_node)
        killed_round = before["rounds_completed"]
        os.kill(before["devices"][1]["pid"], signal.SIGKILL)  # a rank process of our own daemon
        named = wait_for(lambda: training(victim_node).get("rank_failures"), timeout=60)
        assert "rank 1 (cpu:1): killed by SIGKILL" in named[-1]
        assert victim_node.proc is not None
        assert victim_node.proc.poll() is None  # the daemon survives
        infos = wait_done(nodes, timeout=200)
        assert infos[1]["rank_restarts"] == 1
        assert len(final_hashes(nodes, rounds=rounds)) == 1
        # rejoined within two rounds: a sync with both nodes no later than two rounds after the kill
        members = sync_members(log_from(victim_node))
        later = [i + 1 for i, n in enumerate(members) if n == 2 and i + 1 > killed_round]
        assert later, members
        assert later[0] <= killed_round + 2, members
        status = run_cli("status", "--data-dir", str(victim_node.data_dir))
        assert "rank 1 (cpu:1): killed by SIGKILL" in status.stdout


@pytest.mark.parametrize(
    ("devices", "says"),
    [
        ("cpu:0", "cpu:N needs N >= 1"),
        ("tpu:0", "train.devices must be auto, cpu:N or a list"),
        ("cuda:7", "device cuda:7 is not available"),
        ("cpu:4096", "asks for 4096 CPU ranks, more than this machine's"),
    ],
)
def test_bad_devices_stop_join_in_one_line(tmp_path: Path, devices: str, says: str) -> None:
    result = run_cli(
        "join", "--data-dir", str(tmp_path / "d"), "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off",
        "--train", "--devices", devices, timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert says in lines[0]
