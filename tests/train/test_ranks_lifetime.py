"""A rank process lives exactly as long as the daemon that started it: not less when the
thread that started it ends (trio starts processes from worker threads that end when idle),
not more when the daemon is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lattica.train.engine.ranks.group import WORKER_MODULE

pytestmark = pytest.mark.timeout(120)


def _reading_its_orders(pid: int) -> bool:
    """The worker's main thread is blocked reading fd 0: it is past its start-up, waiting for ``init``."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return fields[:2] == ["0", "0x0"]


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return True


def _wait_until(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False


def test_a_rank_outlives_the_thread_that_started_it() -> None:
    started: list[subprocess.Popen[bytes]] = []

    def start_and_end() -> None:
        env = {**os.environ, "LATTICA_RANK_PARENT": str(os.getpid())}
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        started.append(proc)
        assert _wait_until(lambda: _reading_its_orders(proc.pid), 90), "the worker never waited for its orders"

    thread = threading.Thread(target=start_and_end)
    thread.start()
    thread.join()
    (proc,) = started
    try:
        time.sleep(1.5)  # the starting thread has ended; a parent-death signal tied to it would have fired
        assert proc.poll() is None, f"the rank died with the thread that started it (exit {proc.returncode})"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_rank_dies_when_its_daemon_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank.pid"
    daemon = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        proc = subprocess.Popen([sys.executable, "-m", {WORKER_MODULE!r}], stdin=subprocess.PIPE,
                                env={{**os.environ, "LATTICA_RANK_PARENT": str(os.getpid())}})
        open({str(pid_file)!r}, "w").write(str(proc.pid))
        time.sleep(600)
    """)])
    rank_pid = 0
    try:
        assert _wait_until(pid_file.exists, 30)
        time.sleep(0.2)
        rank_pid = int(pid_file.read_text())
        assert _wait_until(lambda: _reading_its_orders(rank_pid), 90), "the worker never waited for its orders"
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        assert _wait_until(lambda: _gone(rank_pid), 10), "the rank outlived its daemon"
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        if rank_pid and not _gone(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
