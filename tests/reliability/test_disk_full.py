"""A full disk under a real training daemon: training goes on, writes resume when space returns.

The data dir of a ``lattica join --train`` daemon is a small tmpfs (a real filesystem that
fills up; root only). The test fills it to the last byte: the daemon says once, in one line,
which file it cannot write and how much space is left (log and ``lattica status``), keeps
training with the state in memory, keeps its older checkpoints intact and leaves no partial
one; its replicated-state log holds new records in memory instead of taking the daemon down.
Once the filler is removed, checkpoints and the state log resume without a restart, and the
records accepted meanwhile are in the log, in order. The daemon log is kept outside the small
disk, as a user's journal would be.

The pieces on the same kind of disk, in process: the checkpoint store, the state log that holds
records, the checkpoint writer's backoff, a new identity and the crash log.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio

from lattica.cli import main as cli_main
from lattica.crdt.durable import state_log_path
from lattica.crdt.log import AppendLog, HeldRecordsLog, read_records
from lattica.errors import StorageError
from lattica.files import WriteRetry
from lattica.train.engine.checkpoint import CheckpointStore
from lattica.train.engine.checkpoint_writer import CheckpointWriter
from lattica_lab.daemons import DaemonProcess, run_cli, wait_for
from lattica_lab.full_disk import (
    disk_unavailable_reason,
    fill,
    kept_full,
    small_tmpfs,
    use_all_inodes,
)
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    killed_at_end,
    rounds_completed,
    train_args,
    training,
)

pytestmark = pytest.mark.skipif(disk_unavailable_reason() is not None, reason=str(disk_unavailable_reason()))

DISK_BYTES = 16 * 1024 * 1024  # three checkpoints of the tiny model (2.4 MB each), one being written, the log
NO_SPACE = "No space left on device"
FREE = re.compile(r"\(\d+(\.\d+)? [KMG]?i?B free of \d+(\.\d+)? [KMG]?i?B\)")
STEP = re.compile(r"^step-(\d+)\.pt$")


@dataclass
class DaemonLoggingElsewhere(DaemonProcess):
    log_file: Path | None = None

    @property
    def log_path(self) -> Path:
        assert self.log_file is not None
        return self.log_file


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", DISK_BYTES) as mount:
        yield mount


def _steps(folder: Path) -> list[int]:
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return sorted(int(m.group(1)) for name in names if (m := STEP.match(name)))


def _own_seqs(log: Path, peer_id: str) -> list[int]:
    """The seqs of our own member record's updates in the state log, in file order."""
    return [r["seq"] for r in read_records(log) if isinstance(r, dict) and r.get("writer") == peer_id == r.get("doc")]


def _lines(log: str, *words: str) -> list[str]:
    return [line for line in log.splitlines() if all(w in line for w in words)]


def _names_the_full_disk(line: str, path: Path) -> bool:
    """One line with the file that cannot be written, why, and the space left."""
    return "\n" not in line and str(path) in line and NO_SPACE in line and FREE.search(line) is not None


def test_a_full_disk_pauses_checkpoints_and_the_state_log_not_training(disk: Path, tmp_path: Path) -> None:
    node = DaemonLoggingElsewhere(
        disk / "node", log_file=tmp_path / "daemon.log", env=TRAIN_ENV,
        extra_args=train_args("diloco", rounds=10_000, inner_steps=5, min_peers=1),
    )
    checkpoints = node.data_dir / "checkpoints"
    with killed_at_end() as daemons:
        daemons.append(node.start())
        node.wait_ready(timeout=60)
        peer_id = node.peer_id
        state_log = state_log_path(node.data_dir, "default")
        assert wait_for(lambda: len(_steps(checkpoints)) >= 2, timeout=120), node.log()
        seq_before = max(_own_seqs(state_log, peer_id))

        with kept_full(disk):
            info = wait_for(lambda: training(node).get("checkpoints"), timeout=60)
            assert info, (training(node), node.log())
            assert _names_the_full_disk(info, checkpoints), info
            state_problem = wait_for(lambda: node.call("status")["state"].get("log"), timeout=30)
            assert state_problem, node.log()
            assert _names_the_full_disk(state_problem, state_log), state_problem
            full_at = rounds_completed(node)
            assert wait_for(lambda: rounds_completed(node) >= full_at + 5, timeout=60), node.log()
            assert training(node)["phase"] == "training"
            status = run_cli("status", "--data-dir", str(node.data_dir))
            assert status.returncode == 0, status.stderr
            assert NO_SPACE in status.stdout  # what the user sees, as it is printed
            kept = _steps(checkpoints)
            assert len(kept) >= 2
            for step in kept:  # the older checkpoints are intact
                assert torch.load(checkpoints / f"step-{step:09d}.pt", weights_only=True)["step"] == step
            # a failed attempt leaves nothing behind (one may be under way at any moment)
            assert wait_for(lambda: [p.name for p in checkpoints.iterdir() if not STEP.match(p.name)] == [], 10)

        assert wait_for(lambda: _steps(checkpoints)[-1] > kept[-1], timeout=60), node.log()
        assert wait_for(lambda: "checkpoints" not in training(node), timeout=30), training(node)
        assert wait_for(lambda: "log" not in node.call("status")["state"], timeout=60), node.call("status")
        assert node.proc is not None
        assert node.proc.poll() is None  # never restarted, never exited
        seqs = _own_seqs(state_log, peer_id)
        held = [s for s in seqs if s > seq_before]
        assert held == list(range(seq_before + 1, seq_before + 1 + len(held))), seqs  # all, in order
        assert len(held) >= 5  # heartbeats while the disk was full, written once it was not

        log = node.log_path.read_text()
        said = _lines(log, NO_SPACE)
        assert all(_names_the_full_disk(line, node.data_dir) for line in said), said
        pairs = (("checkpoints failing", "checkpoints written again"), ("state log failing", "written again ("))
        for failing, again in pairs:
            # said once while it lasted, however many attempts failed (the disk filled once; a
            # failed checkpoint frees its temporary, which the filler takes back within 10 ms)
            episodes = len(_lines(log, failing, NO_SPACE))
            assert 1 <= episodes == len(_lines(log, again)), said
        assert "Traceback" not in log
        assert "enforce fail" not in log


def test_a_full_state_log_does_not_end_a_daemon(disk: Path, tmp_path: Path) -> None:
    node = DaemonLoggingElsewhere(disk / "node", log_file=tmp_path / "daemon.log").start()
    try:
        node.wait_ready(timeout=60)
        state_log = state_log_path(node.data_dir, "default")
        with kept_full(disk):  # the next lease renewals (every second) cannot be written
            problem = wait_for(lambda: node.call("status")["state"].get("log"), timeout=30)
            assert problem, node.log()
            assert _names_the_full_disk(problem, state_log), problem
        assert wait_for(lambda: "log" not in node.call("status")["state"], timeout=60), node.log()
        assert node.proc is not None
        assert node.proc.poll() is None
    finally:
        node.kill()


# -- the pieces, in process ----------------------------------------------------------------------


def _megabyte_state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((256, 1024), float(step))}


def test_a_checkpoint_on_a_full_disk_fails_in_one_line_and_keeps_the_older_ones(disk: Path) -> None:
    store = CheckpointStore(disk / "checkpoints", keep=2)
    store.save(1, _megabyte_state(1))
    store.save(2, _megabyte_state(2))
    fill(disk / "filler")
    with pytest.raises(StorageError) as failed:
        store.save(3, _megabyte_state(3))
    assert _names_the_full_disk(str(failed.value), store.directory / "step-000000003.pt"), failed.value
    assert sorted(p.name for p in store.directory.iterdir()) == ["step-000000001.pt", "step-000000002.pt"]
    assert store.load_latest()["step"] == 2  # type: ignore[index]

    (disk / "filler").unlink()
    store.save(3, _megabyte_state(3))
    assert [step for step, _ in store.checkpoints()] == [2, 3]


def test_a_checkpoint_folder_that_cannot_be_created_fails_the_save_not_the_store(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", DISK_BYTES, inodes=64) as disk:
        taken = use_all_inodes(disk)
        store = CheckpointStore(disk / "checkpoints")  # the trainer is built with it
        assert store.load_latest() is None
        with pytest.raises(StorageError) as failed:
            store.save(1, _megabyte_state(1))
        assert "cannot write checkpoint" in str(failed.value)
        assert str(failed.value).endswith("no inodes left)"), failed.value
        for path in taken[:2]:  # the folder and the temporary file
            path.unlink()
        store.save(1, _megabyte_state(1))
        assert store.load_latest()["step"] == 1  # type: ignore[index]


def test_the_state_log_holds_records_through_a_full_disk_and_writes_them_in_order(disk: Path) -> None:
    path = disk / "state.log"
    log = HeldRecordsLog(AppendLog.open(path)[0], retry=WriteRetry(first_s=1.0))
    assert log.append([{"n": 0}], now=0.0)
    fill(disk / "filler")
    big = {"pad": b"x" * 8192}  # past the partial page the log's last write left
    assert not log.append([{"n": 1, **big}], now=1.0)
    assert log.failing is not None
    assert _names_the_full_disk(log.failing, path), log.failing
    assert not log.append([{"n": 2}], now=1.5)  # backoff: held, not tried
    assert log.held == 2
    assert read_records(path) == [{"n": 0}]  # what was written is intact, nothing torn after it

    (disk / "filler").unlink()
    assert log.append([{"n": 3}], now=2.5)
    assert log.failing is None
    assert log.held == 0
    log.close()
    assert [r["n"] for r in AppendLog.open(path)[1]] == [0, 1, 2, 3]  # type: ignore[index]


def test_records_held_past_the_cap_come_back_with_a_rewrite(disk: Path) -> None:
    path = disk / "state.log"
    log = HeldRecordsLog(AppendLog.open(path)[0], max_held=2)
    fill(disk / "filler")
    assert not log.append([{"n": n, "pad": b"x" * 8192} for n in range(3)], now=0.0)
    assert log.held == 2
    (disk / "filler").unlink()
    assert not log.append([], now=60.0)  # the oldest one is gone: appending the rest would skip it
    assert log.needs_rewrite(max_records=10**6, now=60.0)
    assert log.rewrite([{"n": n} for n in range(3)], now=60.0)  # everything the state needs
    assert log.failing is None
    log.close()
    assert [r["n"] for r in AppendLog.open(path)[1]] == [0, 1, 2]  # type: ignore[index]


def test_a_compaction_that_does_not_fit_is_postponed_while_appends_go_on(disk: Path) -> None:
    path = disk / "state.log"
    log = HeldRecordsLog(AppendLog.open(path)[0])
    records = [{"n": n, "pad": b"x" * 1024} for n in range(64)]
    assert log.append(records, now=0.0)
    fill(disk / "filler")
    os.truncate(disk / "filler", (disk / "filler").stat().st_size - 16384)  # room for appends, not a copy
    assert log.needs_rewrite(max_records=32, now=0.0)
    assert not log.rewrite(records[32:], now=0.0)
    assert log.failing is None  # nothing is held, nothing lost
    assert not log.needs_rewrite(max_records=32, now=0.5)  # postponed
    assert log.append([{"n": 64}], now=0.5)
    assert not list(disk.glob("*.compact"))  # the copy that did not fit is gone

    (disk / "filler").unlink()
    assert log.needs_rewrite(max_records=32, now=1.0)
    assert log.rewrite([*records[32:], {"n": 64}], now=1.0)
    log.close()
    assert [r["n"] for r in AppendLog.open(path)[1]] == list(range(32, 65))  # type: ignore[index]


async def test_a_failing_checkpoint_is_said_once_and_retried_after_a_backoff(
    disk: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    writer = CheckpointWriter(
        CheckpointStore(disk / "checkpoints"), retry=WriteRetry(first_s=1.0, max_s=4.0), clock=lambda: now[0],
    )
    fill(disk / "filler")
    for step in range(1, 4):  # the first fails; the next two come before the backoff is over
        assert await writer.save(lambda step=step: _megabyte_state(step)) is None  # type: ignore[misc]
        now[0] += 0.3
    assert writer.failing is not None
    assert _names_the_full_disk(writer.failing, disk / "checkpoints"), writer.failing
    assert len([r for r in caplog.records if "checkpoints failing" in r.getMessage()]) == 1

    (disk / "filler").unlink()
    assert await writer.save(lambda: _megabyte_state(4)) is None  # 0.9 s: not tried yet, though it would fit
    now[0] = 1.0
    assert await writer.save(lambda: _megabyte_state(5)) == disk / "checkpoints" / "step-000000005.pt"
    assert writer.failing is None


async def test_a_last_checkpoint_that_failed_is_written_once_space_returns(disk: Path) -> None:
    """After the last round no later round brings another attempt: ``until_written`` does."""
    writer = CheckpointWriter(
        CheckpointStore(disk / "checkpoints"), retry=WriteRetry(first_s=0.1, max_s=0.4), clock=trio.current_time,
    )
    fill(disk / "filler")
    assert await writer.save(lambda: _megabyte_state(7)) is None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.until_written, lambda: _megabyte_state(7))
        await trio.sleep(1.5)  # retried all along, in vain
        assert writer.failing is not None
        (disk / "filler").unlink()
        with trio.fail_after(10):  # one backoff later, and the write's own time
            while writer.failing is not None:
                await trio.sleep(0.05)
    assert [step for step, _ in writer.store.checkpoints()] == [7]


def test_a_new_identity_on_a_full_disk_fails_in_one_line(disk: Path) -> None:
    fill(disk / "filler")
    data_dir = disk / "node"
    result = run_cli("join", "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off")
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("lattica: error: cannot write identity key"), line
    assert _names_the_full_disk(line, data_dir / "identity.key"), line
    assert list(data_dir.iterdir()) == []  # no partial key, no crash log


def test_a_crash_on_a_full_disk_says_in_its_one_line_why_no_traceback_was_kept(
    disk: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fill(disk / "filler")
    args = argparse.Namespace(command="join", data_dir=str(disk))
    cli_main._report_internal(args, RuntimeError("a bug"))
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lattica: internal error: RuntimeError: a bug (no traceback kept: "), line
    assert _names_the_full_disk(line, disk / "crash.log"), line

    cli_main._report_internal(args, OSError(28, "No space left on device"))  # from no write we know of
    [line] = capsys.readouterr().err.strip().splitlines()
    assert _names_the_full_disk(line, disk), line
