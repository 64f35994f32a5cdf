"""Real ``lattica join`` processes for tests and benchmarks.

``DaemonProcess`` starts the CLI as a subprocess with its own data dir and a free loopback
port, waits until its control socket answers, and ends exactly the process it started (by
PID) when stopped or when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lattica.control import client
from lattica.errors import LatticaError


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lattica_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lattica.cli.main", *args]


def run_cli(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lattica_command(*args), capture_output=True, text=True, timeout=timeout, env=env
    )


@dataclass
class DaemonProcess:
    data_dir: Path
    port: int = field(default_factory=free_port)
    peers: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    proc: subprocess.Popen[str] | None = None
    log_path: Path | None = None
    netns: str | None = None  # run inside this network namespace (a NetLab host)
    listen_ip: str = "127.0.0.1"

    def start(self) -> DaemonProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "join",
            "--data-dir", str(self.data_dir),
            "--listen", f"/ip4/{self.listen_ip}/tcp/{self.port}",
            "--metrics-addr", "off",
            "--bootstrap-timeout", "20",
            *self.extra_args,
        ]
        for peer in self.peers:
            args += ["--peer", peer]
        self.log_path = self.data_dir / "daemon.log"
        log = self.log_path.open("a")  # a restarted daemon's log follows the one before
        env = {**os.environ, **(self.env or {})}
        command = lattica_command(*args)
        if self.netns is not None:  # `ip netns exec` execs the command: proc.pid is the daemon
            command = ["ip", "netns", "exec", self.netns, *command]
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        log.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            try:
                return self.call("status")
            except LatticaError:
                time.sleep(0.2)
        raise TimeoutError(f"daemon in {self.data_dir} not ready after {timeout} s: {self.log()}")

    def call(self, method: str) -> Any:
        return client.call(self.data_dir / "control.sock", method, timeout=10.0)

    @property
    def addr(self) -> str:
        return self.call("id")["addrs"][0]

    @property
    def peer_id(self) -> str:
        return self.call("id")["peer_id"]

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path and self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cli_json(*args: str, timeout: float = 30.0) -> Any:
    result = run_cli(*args, "--json", timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"lattica {' '.join(args)} failed: {result.stderr.strip()}")
    return json.loads(result.stdout)
