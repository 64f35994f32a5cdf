"""Driving real data-plane peer processes (``lattica_lab.peer_main``) from tests and benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from lattica_lab import lab_env


class PeerProcess:
    def __init__(self, *, fast: bool = True) -> None:
        args = [sys.executable, "-m", "lattica_lab.peer_main"]
        if not fast:
            args.append("--no-fast")
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process; closed in close()
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
            env=lab_env(),
        )
        self.peer_id = ""
        self.addr = ""

    def hello(self, timeout: float = 90.0) -> None:
        info = self.read(timeout)
        self.peer_id, self.addr = info["peer_id"], info["addr"]

    def send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"peer {self.proc.pid} silent for {timeout}s; stderr: {self.error_log()}")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"peer {self.proc.pid} exited; stderr: {self.error_log()}")
        return json.loads(line)

    def command(self, obj: dict, timeout: float = 20.0) -> dict:
        self.send(obj)
        return self.read(timeout)

    def error_log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()  # the peer keeps no state worth a graceful shutdown
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(Exception):
                    pipe.close()
        self.stderr.close()


@contextlib.contextmanager
def spawn_peers(n: int, *, fast: bool = True):
    """Start ``n`` connected peers; every one of them is killed (by PID) on exit."""
    peers = [PeerProcess(fast=fast) for _ in range(n)]
    try:
        for peer in peers:
            peer.hello()
        for i, peer in enumerate(peers[1:], start=1):
            assert peer.command({"op": "connect", "addrs": [p.addr for p in peers[:i]]})["ok"]
        yield peers
    finally:
        for peer in peers:
            peer.close()


def run_all(peers: list[PeerProcess], commands: list[dict], timeout: float = 30.0) -> list[dict]:
    for peer, cmd in zip(peers, commands, strict=True):
        peer.send(cmd)
    deadline = time.monotonic() + timeout
    return [peer.read(max(0.1, deadline - time.monotonic())) for peer in peers]
