"""``lattica stop`` and SIGTERM end the daemon process within 5 s — idle, while training, and
with a service that does not let go — and its port can be listened on again right away."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli, wait_for

PROMISE_S = 5.0
TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "OMP_NUM_THREADS": "1",
}


def _stop_and_time(daemon: DaemonProcess) -> float:
    """Seconds from ``lattica stop`` returning (the daemon took the request) to process exit."""
    result = run_cli("stop", "--data-dir", str(daemon.data_dir))
    assert result.returncode == 0, result.stderr
    started = time.monotonic()
    assert daemon.proc is not None
    try:
        daemon.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 15 s after lattica stop: {daemon.log()}") from None
    return time.monotonic() - started


def _sigterm_and_time(daemon: DaemonProcess) -> float:
    assert daemon.proc is not None
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    try:
        daemon.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 15 s after SIGTERM: {daemon.log()}") from None
    return time.monotonic() - started


def _restart_on_the_same_port(old: DaemonProcess, **kwargs: object) -> DaemonProcess:
    again = DaemonProcess(old.data_dir, port=old.port, **kwargs).start()  # type: ignore[arg-type]
    again.wait_ready(timeout=60)
    assert any(f"/tcp/{old.port}/" in a for a in again.call("id")["addrs"])
    return again


def test_stop_while_idle_ends_the_process_and_frees_its_port(tmp_path):
    daemon = DaemonProcess(tmp_path / "a").start()
    again = None
    try:
        daemon.wait_ready()
        assert _stop_and_time(daemon) < PROMISE_S
        assert daemon.proc is not None
        assert daemon.proc.returncode == 0, daemon.log()
        assert not (daemon.data_dir / "control.sock").exists()
        again = _restart_on_the_same_port(daemon)
    finally:
        daemon.kill()
        if again is not None:
            again.kill()


def _training(daemon: DaemonProcess) -> dict[str, object]:
    return daemon.call("status").get("training") or {}


def _rounds(daemon: DaemonProcess) -> int:
    return int(_training(daemon).get("rounds_completed") or 0)


@pytest.fixture
def wide_umask():
    old = os.umask(0o022)  # inherited by the daemons: files 0644 unless they say otherwise
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("wide_umask")
def test_stop_and_sigterm_while_training_end_within_five_seconds(tmp_path):
    args = (
        "--train", "--model", "tiny", "--device", "cpu", "--rounds", "1000", "--inner-steps", "5",
        "--min-peers", "2", "--log-level", "info",
    )
    first = DaemonProcess(tmp_path / "a", extra_args=args, env=TRAIN_ENV).start()
    daemons = [first]
    try:
        first.wait_ready(timeout=60)
        second = DaemonProcess(tmp_path / "b", peers=(first.addr,), extra_args=args, env=TRAIN_ENV).start()
        daemons.append(second)
        second.wait_ready(timeout=60)
        assert wait_for(lambda: _rounds(first) >= 1 and _rounds(second) >= 1, timeout=120), first.log()
        assert _training(first).get("phase") == "training"
        # the run's weights, written while training, are for the owner only
        checkpoints = first.data_dir / "checkpoints"
        assert stat.S_IMODE(checkpoints.stat().st_mode) == 0o700
        saved = list(checkpoints.iterdir())
        assert saved
        assert [p.name for p in saved if stat.S_IMODE(p.stat().st_mode) != 0o600] == []

        assert _stop_and_time(first) < PROMISE_S
        assert _sigterm_and_time(second) < PROMISE_S
        assert [d.proc.returncode for d in daemons if d.proc is not None] == [0, 0]
        daemons.append(_restart_on_the_same_port(first, extra_args=args, env=TRAIN_ENV))
    finally:
        for d in daemons:
            d.kill()


def test_a_service_stuck_in_a_thread_does_not_hold_the_process(tmp_path: Path):
    script = Path(__file__).with_name("stuck_service_daemon.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "stuck")], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert time.monotonic() - started < PROMISE_S
        assert proc.returncode == 0
        assert "did not stop within" in proc.stdout.read()
        assert not (tmp_path / "stuck" / "control.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
