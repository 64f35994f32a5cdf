"""Real ``lattica join`` processes for tests and benchmarks.

``DaemonProcess`` starts the CLI as a subprocess with its own data dir and a free loopback
port, waits until its control socket answers, and ends exactly the process it started (by
PID) when stopped or when the test ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lattica.cli import demo
from lattica.cli.demo import free_port, lattica_command

__all__ = ["DaemonProcess", "cli_json", "free_port", "lattica_command", "run_cli", "wait_for"]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def run_cli(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lattica_command(*args), capture_output=True, text=True, timeout=timeout, env=env
    )


@dataclass
class DaemonProcess(demo.DaemonProcess):
    """The product's daemon process (``lattica demo`` starts the same), with what tests need
    beside it: extra environment, a network namespace to run in, signals and a hard kill."""

    env: dict[str, str] | None = None
    netns: str | None = None  # run inside this network namespace (a NetLab host)

    def command(self) -> list[str]:
        command = super().command()
        if self.netns is not None:  # `ip netns exec` execs the command: proc.pid is the daemon
            command = ["ip", "netns", "exec", self.netns, *command]
        return command

    def environment(self) -> dict[str, str] | None:
        base = super().environment()
        if not self.env:
            return base
        return {**(base if base is not None else os.environ), **self.env}

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        return super().wait_ready(timeout)

    def call(self, method: str) -> Any:
        return super().call(method)

    @property
    def peer_id(self) -> str:
        return self.call("id")["peer_id"]

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cli_json(*args: str, timeout: float = 30.0) -> Any:
    result = run_cli(*args, "--json", timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"lattica {' '.join(args)} failed: {result.stderr.strip()}")
    return json.loads(result.stdout)
