"""The durable log: torn tails, corrupted records, compaction, and kill -9 mid-append."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from crdt_append_worker import CONFIG

from lattica.crdt import ReplicatedState
from lattica.crdt.log import MAGIC, AppendLog
from lattica.net.host import build_host
from lattica.net.identity import load_or_create_identity

WORKER = Path(__file__).with_name("crdt_append_worker.py")


def test_append_and_reopen(tmp_path):
    log, records = AppendLog.open(tmp_path / "s.log")
    assert records == []
    log.append([{"n": i} for i in range(3)])
    log.append([{"n": 3}])
    log.close()
    log, records = AppendLog.open(tmp_path / "s.log")
    assert records == [{"n": i} for i in range(4)]
    assert log.torn_bytes == 0
    assert log.record_count == 4
    log.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_torn_last_record_is_detected_and_skipped(tmp_path, damage):
    path = tmp_path / "s.log"
    log, _ = AppendLog.open(path)
    log.append([{"n": 0}, {"n": 1, "blob": b"x" * 100}])
    log.close()
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-7])
    elif damage == "flip":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    else:
        path.write_bytes(data + b"\x00\x00\xff\xff\x12")
    log, records = AppendLog.open(path)
    expected = [{"n": 0}] if damage != "garbage" else [{"n": 0}, {"n": 1, "blob": b"x" * 100}]
    assert records == expected
    assert log.torn_bytes > 0
    log.append([{"n": 2}])  # appends continue from a clean boundary
    log.close()
    _, records = AppendLog.open(path)
    assert records == [*expected, {"n": 2}]


def test_rewrite_compacts_atomically(tmp_path):
    path = tmp_path / "s.log"
    log, _ = AppendLog.open(path)
    log.append([{"n": i} for i in range(100)])
    big = log.size_bytes
    log.rewrite([{"n": 99}])
    assert log.size_bytes < big
    assert log.record_count == 1
    log.append([{"n": 100}])
    log.close()
    assert AppendLog.open(path)[1] == [{"n": 99}, {"n": 100}]
    assert not path.with_name("s.log.compact").exists()


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "s.log"
    path.write_bytes(b"hello world, not a log")
    with pytest.raises(ValueError, match="not a state log"):
        AppendLog.open(path)
    path.write_bytes(MAGIC[:3])  # crash while creating: treated as empty
    assert AppendLog.open(path)[1] == []


async def _read_lines(proc, until: int) -> list[str]:
    buffer = b""
    while buffer.count(b"\n") < until:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            break
        buffer += chunk
    return buffer.decode().splitlines()


async def test_kill_9_during_appends_loses_no_acknowledged_update(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(WORKER), str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        with trio.fail_after(30):
            lines = await _read_lines(proc, until=60)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
    # lines read after the kill are acknowledged too: they were printed after fsync
    rest = await proc.stdout.receive_some(1 << 20)
    lines += (rest or b"").decode().splitlines()
    acked = [int(line.split()[1]) for line in lines if line.startswith("acked ")]
    assert len(acked) >= 50

    key_pair = load_or_create_identity(tmp_path)
    state = ReplicatedState(build_host(key_pair), key_pair, data_dir=tmp_path, run_id="crash", config=CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(state.run)
        manifest = state.snapshot()["checkpoints"]
        missing = [r for r in acked if f"h{r}" not in manifest.get(str(r), {})]
        assert missing == []
        await state.add_checkpoint(10**9, ["after-restart"])  # the stream continues cleanly
        assert state.counters()["updates_rejected"] == {}
        assert state.counters()["log_bytes"] > 0
        nursery.cancel_scope.cancel()


async def test_offline_snapshot_matches_the_daemons(tmp_path):
    from lattica.crdt.offline import read_snapshot

    key_pair = load_or_create_identity(tmp_path)
    state = ReplicatedState(build_host(key_pair), key_pair, data_dir=tmp_path, run_id="off")
    async with trio.open_nursery() as nursery:
        await nursery.start(state.run)
        await state.set_run_config({"model": "m", "batch": 2**40})
        await state.set_progress(12, "abc")
        nursery.cancel_scope.cancel()
    expected = state.snapshot()  # the service has stopped: nothing writes any more
    assert expected["progress"][state.peer_id]["round"] == 12
    assert read_snapshot(tmp_path, "off", admins=[state.peer_id]) == expected
    assert read_snapshot(tmp_path, "off", admins=[])["config"] == {}
    assert read_snapshot(tmp_path, "other", admins=[]) == read_snapshot(tmp_path / "none", "x", admins=[])


async def test_writes_racing_shutdown_neither_fail_nor_touch_a_closed_log(tmp_path):
    # A daemon shutting down: the training service still publishes progress while the state
    # service's run() ends and closes its log. The write used to hit the closed descriptor
    # (OSError: Bad file descriptor) and take the process down with a non-zero exit.
    key_pair = load_or_create_identity(tmp_path)
    state = ReplicatedState(build_host(key_pair), key_pair, data_dir=tmp_path, run_id="race")
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(state.run)
            await state.set_progress(1, "first")
            outer.start_soon(state.set_progress, 2, "racing")  # in flight as run() ends
            await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        await state.set_progress(3, "after")  # run() is over: in memory only
    assert state.snapshot()["progress"][state.peer_id]["round"] == 3
    from lattica.crdt.offline import read_snapshot

    stored = read_snapshot(tmp_path, "race", admins=[state.peer_id])
    assert stored["progress"][state.peer_id]["round"] in (1, 2)  # what was persisted is intact
