"""Throughput of one bulk transfer between two processes on loopback: fast path, libp2p, raw TCP.

Each measurement is a round trip: the sender times from the first byte until a tiny
acknowledgement comes back after the receiver holds every byte. Raw TCP moves the same bytes
with no encryption and no framing, in the same run, as the reference.

    .venv/bin/python benchmarks/transfer.py [--mib 256] [--reps 2]

Prints a table, then one JSON line with ``fast_vs_tcp`` and ``libp2p_vs_tcp`` (throughput
ratios, best of ``--reps``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

from lattica.net.tensors._peer_driver import spawn_peers

CHUNK = 4 << 20


def _tcp_receiver(port_out, nbytes: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_out(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            buf = bytearray(nbytes)  # the same destination buffer the data plane allocates
            view, got = memoryview(buf), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], min(CHUNK, nbytes - got))
                if not n:
                    raise EOFError("sender left early")
                got += n
            conn.sendall(b"k")


def raw_tcp_seconds(nbytes: int) -> float:
    code = (
        "import sys; sys.path.insert(0, '.'); from benchmarks.transfer import _tcp_receiver;"
        f"_tcp_receiver(lambda p: print(p, flush=True), {nbytes})"
    )
    receiver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(receiver.stdout.readline())
        data = memoryview(bytes(nbytes))
        with socket.create_connection(("127.0.0.1", port)) as conn:
            start = time.perf_counter()
            for i in range(0, nbytes, CHUNK):
                conn.sendall(data[i : i + CHUNK])
            if conn.recv(1) != b"k":
                raise EOFError("no acknowledgement")
            seconds = time.perf_counter() - start
        receiver.wait(timeout=30)
        return seconds
    finally:
        receiver.kill()
        receiver.wait()


def tensor_seconds(nbytes: int, *, fast: bool, reps: int) -> list[float]:
    with spawn_peers(2, fast=fast) as (sender, receiver):
        times = []
        for rep in range(reps + 1):  # rep 0 is a small warm-up (sets up the fast channel)
            size = 1 << 20 if rep == 0 else nbytes
            tag = f"blob{rep}"
            receiver.send({"op": "blob_recv", "peer": sender.peer_id, "tag": tag})
            reply = sender.command(
                {"op": "blob_send", "peer": receiver.peer_id, "tag": tag, "nbytes": size}, timeout=300
            )
            assert receiver.read(60)["nbytes"] == size
            if rep:
                times.append(reply["seconds"])
        return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    nbytes = args.mib << 20
    tcp = min(raw_tcp_seconds(nbytes) for _ in range(args.reps))
    fast = min(tensor_seconds(nbytes, fast=True, reps=args.reps))
    libp2p = min(tensor_seconds(nbytes, fast=False, reps=args.reps))
    rows = [("raw TCP", tcp), ("fast path (AES-GCM)", fast), ("libp2p Noise+Yamux", libp2p)]
    print(f"{'path':<22}{'seconds':>10}{'MB/s':>10}")
    for name, seconds in rows:
        print(f"{name:<22}{seconds:>10.3f}{nbytes / seconds / 1e6:>10.0f}")
    print(json.dumps({
        "mib": args.mib,
        "tcp_mb_s": round(nbytes / tcp / 1e6, 1),
        "fast_mb_s": round(nbytes / fast / 1e6, 1),
        "libp2p_mb_s": round(nbytes / libp2p / 1e6, 1),
        "fast_vs_tcp": round(tcp / fast, 3),
        "libp2p_vs_tcp": round(tcp / libp2p, 3),
    }))


if __name__ == "__main__":
    main()
