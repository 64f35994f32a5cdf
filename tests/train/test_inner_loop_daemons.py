"""The inner-loop settings through real ``lattica join --train`` daemons: replicas still agree
bit for bit, and ``lattica status`` says how the node trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    killed_at_end,
    train_args,
    training,
    wait_done,
)

pytestmark = pytest.mark.timeout(150)

SPEED_ARGS = (
    "--micro-batches", "2", "--activation-checkpointing", "--outer-state-device", "same", "--compile", "false",
)


def test_two_daemons_with_micro_batches_checkpointing_and_outer_state_on_the_device_agree(tmp_path: Path) -> None:
    args = (*train_args("diloco", rounds=2, inner_steps=4, min_peers=2), *SPEED_ARGS)
    with killed_at_end() as started:
        first = DaemonProcess(tmp_path / "a", extra_args=args, env=TRAIN_ENV).start()
        started.append(first)
        first.wait_ready(60)
        second = DaemonProcess(tmp_path / "b", peers=(first.addr,), extra_args=args, env=TRAIN_ENV).start()
        started.append(second)
        second.wait_ready(60)
        infos = wait_done([first, second], timeout=120)
        assert [i["rounds_completed"] for i in infos] == [2, 2]
        assert len(final_hashes([first, second], rounds=2)) == 1
        info = training(first)
        assert info["compiled"] is False
        assert info["tokens_per_s"] > 0
        assert "mfu" not in info  # the CPU has no known peak: no figure rather than a guess


def test_a_setting_the_strategy_does_not_use_stops_join_in_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "join", "--data-dir", str(tmp_path / "d"), "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off",
        "--train", "--strategy", "streaming", "--outer-state-device", "same", timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "outer_state_device is not used by strategy 'streaming'" in lines[0]
