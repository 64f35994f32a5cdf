"""Throughput of one bulk transfer between two processes on loopback: fast path, libp2p, raw TCP.

Every path is measured the same way, so their ratios mean something:

- one pair of long-lived processes per path, connected before any timing (raw TCP: one TCP
  connection; fast path: its channel; libp2p: the host connection, a fresh stream per message
  as the data plane opens);
- the sender sends one reused tensor whose pages were touched before timing; the receiver lands
  the bytes in one reused, pre-touched buffer (the tensor paths post it, as a collective does);
  so no page fault of a fresh buffer falls in any timed window;
- one untimed warm-up rep of the full size, then ``--reps`` timed reps, the paths taking turns
  rep by rep (tcp, fast, libp2p, tcp, ...) so that load from other processes hits them alike;
- a rep is a round trip: the sender times from its first byte until a tiny acknowledgement
  comes back after the receiver holds every byte. Best of the reps (the median is printed too).
  Each rep also sums both processes' CPU seconds: ``fast_vs_tcp_cpu`` (the reference's CPU
  over the fast path's, fewest of the reps) is what the throughput ratio tends to when other
  work keeps both cores busy.

Raw TCP moves the same bytes with no encryption and no framing: the reference.

    .venv/bin/python benchmarks/transfer.py [--mib 256] [--reps 4]

A rep that fails (a peer exits, a timeout, a short transfer) fails the run: exit status 1 and
one line on stderr, no figures. Prints a table, then one JSON line with ``tcp_mb_s``,
``fast_mb_s``, ``libp2p_mb_s``, ``fast_vs_tcp`` and ``libp2p_vs_tcp`` (throughput ratios of the
best reps).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.peer_driver import PeerProcess, spawn_peers

ACK_TIMEOUT_S = 300.0
PATHS = ("tcp", "fast", "libp2p")


class BenchmarkFailed(RuntimeError):
    """A measurement did not complete: the benchmark reports no figures."""


def _tcp_receiver(port_out: Callable[[int], None], nbytes: int, reps: int) -> None:
    """One connection, ``reps`` transfers into one reused, pre-touched buffer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_out(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            buf = bytearray(b"\x01" * nbytes)  # touched before the first byte arrives
            view = memoryview(buf)
            for _ in range(reps):
                got, cpu_start = 0, time.process_time()
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if not n:
                        raise EOFError("sender left early")
                    got += n
                conn.sendall(b"k")
                print(time.process_time() - cpu_start, flush=True)


class RawTcp:
    """The reference: plain sockets, same process layout and buffer policy as the tensor paths."""

    def __init__(self, nbytes: int, reps: int) -> None:
        here = str(Path(__file__).resolve().parent)
        code = (
            f"import sys; sys.path.insert(0, {here!r}); from transfer import _tcp_receiver;"
            f"_tcp_receiver(lambda p: print(p, flush=True), {nbytes}, {reps})"
        )
        self._receiver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self._receiver.stdout is not None
        line = self._receiver.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise BenchmarkFailed("raw TCP receiver did not start")
        self._conn = socket.create_connection(("127.0.0.1", int(line)))
        self._conn.settimeout(ACK_TIMEOUT_S)
        self._data = memoryview(b"\x01" * nbytes)

    def measure(self) -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        self._conn.sendall(self._data)
        if self._conn.recv(1) != b"k":
            raise BenchmarkFailed("raw TCP: no acknowledgement (receiver failed)")
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        assert self._receiver.stdout is not None
        return seconds, cpu + float(self._receiver.stdout.readline())

    def close(self) -> None:
        if getattr(self, "_conn", None) is not None:
            self._conn.close()
        self._receiver.kill()  # our own child, by its handle
        self._receiver.wait()


class TensorPath:
    """Two ``lattica_lab.peer_main`` processes exchanging one raw uint8 tensor per rep."""

    def __init__(self, peers: list[PeerProcess], nbytes: int, name: str) -> None:
        self.sender, self.receiver = peers
        self.nbytes, self.name, self._rep = nbytes, name, 0

    def measure(self) -> tuple[float, float]:
        tag = f"blob{self._rep}"
        self._rep += 1
        peer = {"peer": self.sender.peer_id, "tag": tag, "nbytes": self.nbytes}
        if not self.receiver.command({"op": "blob_post", **peer}).get("ok"):
            raise BenchmarkFailed(f"{self.name}: the receiver could not post its buffer")
        self.receiver.send({"op": "blob_recv", **peer})
        reply = self.sender.command(
            {"op": "blob_send", "peer": self.receiver.peer_id, "tag": tag, "nbytes": self.nbytes},
            timeout=ACK_TIMEOUT_S,
        )
        got = self.receiver.read(60)
        if not reply.get("ok") or got.get("nbytes") != self.nbytes:
            raise BenchmarkFailed(f"{self.name}: transfer incomplete ({reply}, {got})")
        return float(reply["seconds"]), float(reply["cpu_s"]) + float(got["cpu_s"])


Reps = dict[str, list[tuple[float, float]]]  # path -> [(seconds, CPU seconds of both sides)]


def summarize(nbytes: int, reps_by_path: Reps, reps: int) -> dict[str, float]:
    """The JSON figures from every path's timed reps; raises if any path missed a rep."""
    for path in PATHS:
        got = reps_by_path.get(path, [])
        if len(got) != reps or not all(t > 0 for t, _ in got):
            raise BenchmarkFailed(f"{path}: {len(got)} of {reps} reps measured; no figures reported")
    best = {path: min(t for t, _ in reps_by_path[path]) for path in PATHS}
    cpu = {path: min(c for _, c in reps_by_path[path]) for path in PATHS}

    def mb_s(path: str) -> float:
        return round(nbytes / best[path] / 1e6, 1)

    return {
        "mib": nbytes >> 20,
        "reps": reps,
        "tcp_mb_s": mb_s("tcp"),
        "fast_mb_s": mb_s("fast"),
        "libp2p_mb_s": mb_s("libp2p"),
        "fast_vs_tcp": round(best["tcp"] / best["fast"], 3),
        "libp2p_vs_tcp": round(best["tcp"] / best["libp2p"], 3),
        "tcp_cpu_s": round(cpu["tcp"], 3),
        "fast_cpu_s": round(cpu["fast"], 3),
        "libp2p_cpu_s": round(cpu["libp2p"], 3),
        "fast_vs_tcp_cpu": round(cpu["tcp"] / cpu["fast"], 3),
    }


def measure(nbytes: int, reps: int) -> Reps:
    times: Reps = {path: [] for path in PATHS}
    tcp = RawTcp(nbytes, reps + 1)
    try:
        with spawn_peers(2, fast=True) as fast_peers, spawn_peers(2, fast=False) as libp2p_peers:
            paths: dict[str, RawTcp | TensorPath] = {
                "tcp": tcp,
                "fast": TensorPath(fast_peers, nbytes, "fast path"),
                "libp2p": TensorPath(libp2p_peers, nbytes, "libp2p"),
            }
            for rep in range(reps + 1):  # rep 0: the warm-up, full size, untimed
                for path, runner in paths.items():
                    measured = runner.measure()
                    if rep:
                        times[path].append(measured)
    except (OSError, EOFError, TimeoutError, KeyError, ValueError, AssertionError) as exc:
        raise BenchmarkFailed(f"a transfer failed: {exc!r}") from None
    finally:
        tcp.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    if args.mib < 1 or args.reps < 1:
        parser.error("--mib and --reps must be at least 1")
    nbytes = args.mib << 20
    try:
        times = measure(nbytes, args.reps)
        result = summarize(nbytes, times, args.reps)
    except BenchmarkFailed as exc:
        print(f"transfer benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    names = {"tcp": "raw TCP", "fast": "fast path (AES-GCM)", "libp2p": "libp2p Noise+Yamux"}
    print(f"{'path':<22}{'best s':>10}{'median s':>10}{'MB/s':>10}{'CPU s':>10}")
    for path, got in times.items():
        seconds = [t for t, _ in got]
        print(f"{names[path]:<22}{min(seconds):>10.3f}{statistics.median(seconds):>10.3f}"
              f"{nbytes / min(seconds) / 1e6:>10.0f}{min(c for _, c in got):>10.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
