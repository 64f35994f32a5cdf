"""Measure what a lab link does to TCP and UDP: connect time, ping-pong, bulk rate, packet rate.

Run inside lab namespaces (``WanLab.spawn`` / ``WanLab.run_in``); every mode prints JSON lines.

- ``serve --port P``: a TCP server on P (and a UDP counter on P). A connection's first byte
  picks its mode: ``e`` echoes, ``s`` sinks until the sender's end of stream and answers the
  bytes received per 100 ms slot, ``c`` answers (and resets) the UDP counters. Prints
  ``{"event": "listening"}`` when ready.
- ``rtt``: ``--connects`` TCP handshakes (SYN to SYN-ACK: one round trip each) and
  ``--pings`` 32-byte ping-pongs on one connection with Nagle off; milliseconds each.
- ``bulk``: send for ``--seconds``; the receiver's rate after ``--warmup`` (slow start).
- ``flood``: UDP datagrams of ``--size`` bytes at up to ``--pps`` for ``--seconds``; how many
  arrived. Shows the packet rate a delay line sustains.
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import statistics
import sys
import threading
import time

SLOT_S = 0.1
PING = b"p" * 32


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed mid-message")
        data += chunk
    return data


class _UdpCounter:
    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("0.0.0.0", port))
        self.lock = threading.Lock()
        self.packets = 0
        self.bytes = 0
        threading.Thread(target=self._count, daemon=True).start()

    def _count(self) -> None:
        while True:
            n = len(self.sock.recv(65536))
            with self.lock:
                self.packets += 1
                self.bytes += n

    def take(self) -> dict:
        with self.lock:
            counts = {"packets": self.packets, "bytes": self.bytes}
            self.packets = self.bytes = 0
        return counts


def serve(port: int) -> None:
    udp = _UdpCounter(port)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = sock.recv(1)
            if mode == b"e":
                while chunk := sock.recv(4096):
                    sock.sendall(chunk)
            elif mode == b"s":
                sock.sendall(json.dumps({"slots": _sink(sock)}).encode() + b"\n")
            elif mode == b"c":
                sock.sendall(json.dumps(udp.take()).encode() + b"\n")

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("0.0.0.0", port), Handler) as server:
        _emit({"event": "listening", "port": port})
        server.serve_forever()


def _sink(sock: socket.socket) -> list[int]:
    """Bytes received per ``SLOT_S`` slot, from the first byte to the end of stream."""
    slots: list[int] = []
    started = None
    while chunk := sock.recv(1 << 20):
        now = time.monotonic()
        if started is None:
            started = now
        slot = int((now - started) / SLOT_S)
        slots.extend([0] * (slot + 1 - len(slots)))
        slots[slot] += len(chunk)
    return slots


def measure_rtt(host: str, port: int, connects: int, pings: int) -> dict:
    connect_ms = []
    for _ in range(connects):
        started = time.perf_counter()
        with socket.create_connection((host, port), timeout=10):
            connect_ms.append((time.perf_counter() - started) * 1000)
    ping_ms = []
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"e")
        for _ in range(pings):
            started = time.perf_counter()
            sock.sendall(PING)
            _recv_exactly(sock, len(PING))
            ping_ms.append((time.perf_counter() - started) * 1000)
    return {
        "connect_ms": connect_ms, "ping_ms": ping_ms,
        "connect_median_ms": statistics.median(connect_ms) if connect_ms else None,
        "ping_median_ms": statistics.median(ping_ms) if ping_ms else None,
    }


def measure_bulk(host: str, port: int, seconds: float, warmup: float) -> dict:
    block = b"\0" * (256 << 10)
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"s")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            sock.sendall(block)
        sock.shutdown(socket.SHUT_WR)
        reply = json.loads(sock.makefile().readline())
    slots = reply["slots"][int(warmup / SLOT_S):-1]  # the last slot is partial
    total = sum(reply["slots"])
    mbit = sum(slots) * 8 / (len(slots) * SLOT_S) / 1e6 if slots else 0.0
    return {"bytes": total, "mbit": mbit, "slots": len(reply["slots"])}


def measure_flood(host: str, port: int, seconds: float, size: int, pps: float | None) -> dict:
    payload = b"\0" * size
    sent = 0
    interval = 1 / pps if pps else 0.0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.connect((host, port))
        started = time.monotonic()
        deadline = started + seconds
        while (now := time.monotonic()) < deadline:
            if interval and sent > (now - started) / interval:
                time.sleep(interval)
                continue
            try:
                udp.send(payload)
                sent += 1
            except OSError:  # local queue full
                time.sleep(0.0005)
        elapsed = time.monotonic() - started
    time.sleep(1.0)  # what is still in flight arrives
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"c")
        counts = json.loads(sock.makefile().readline())
    return {"sent": sent, "received": counts["packets"], "seconds": elapsed,
            "sent_pps": sent / elapsed, "received_pps": counts["packets"] / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lattica_lab.wan_probe", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    serve_p = sub.add_parser("serve")
    serve_p.add_argument("--port", type=int, default=9000)
    for mode in ("rtt", "bulk", "flood"):
        p = sub.add_parser(mode)
        p.add_argument("--host", required=True)
        p.add_argument("--port", type=int, default=9000)
        if mode == "rtt":
            p.add_argument("--connects", type=int, default=10)
            p.add_argument("--pings", type=int, default=20)
        else:
            p.add_argument("--seconds", type=float, default=2.0)
        if mode == "bulk":
            p.add_argument("--warmup", type=float, default=0.5)
        if mode == "flood":
            p.add_argument("--size", type=int, default=64)
            p.add_argument("--pps", type=float, default=None)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args.port)
    elif args.mode == "rtt":
        _emit(measure_rtt(args.host, args.port, args.connects, args.pings))
    elif args.mode == "bulk":
        _emit(measure_bulk(args.host, args.port, args.seconds, args.warmup))
    else:
        _emit(measure_flood(args.host, args.port, args.seconds, args.size, args.pps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
