"""Benchmark of the replicated state: ``python -m lattica_lab.crdt_bench [--replicas N]``.

Measures envelope sign+verify rate, fsync'd log append latency, in-memory convergence of N
replicas after random writes, and the write-to-visible latency between two real libp2p hosts
on loopback. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from pycrdt import Doc

from lattica.crdt import documents
from lattica.crdt.config import StateConfig
from lattica.crdt.log import AppendLog
from lattica.crdt.replica import Replica
from lattica.crdt.state import ReplicatedState
from lattica.net.host import build_host


def bench_envelopes(count: int) -> float:
    writer, reader = (Replica(run_id="b", key_pair=create_new_key_pair(), admins=()) for _ in range(2))
    start = time.perf_counter()
    for i in range(count):
        def progress(doc: Doc, i: int = i) -> None:
            documents.write_progress(doc, round=i, weights_hash="h")

        for env in writer.local_write(writer.peer_id, progress):
            reader.receive(env)
    return count / (time.perf_counter() - start)


def bench_log(directory: Path, count: int) -> float:
    log, _ = AppendLog.open(directory / "bench.log")
    times = []
    for i in range(count):
        start = time.perf_counter()
        log.append([{"n": i, "pad": b"x" * 200}])
        times.append(time.perf_counter() - start)
    log.close()
    return statistics.median(times) * 1000


def bench_convergence(n: int, writes: int) -> dict[str, float]:
    keys = [create_new_key_pair() for _ in range(n)]
    admins = [ID.from_pubkey(keys[0].public_key).to_base58()]
    replicas = [Replica(run_id="b", key_pair=k, admins=admins) for k in keys]
    rng = random.Random(0)
    for i in range(writes):
        r = rng.choice(replicas)
        def lease(doc: Doc, i: int = i) -> None:
            documents.write_lease(doc, lease_expires_ms=i, heartbeat=i)

        r.local_write(r.peer_id, lease)
    start = time.perf_counter()
    rounds = 0
    while len({str(r.state_vector()) for r in replicas}) > 1:
        rounds += 1
        for dst in replicas:
            src = rng.choice(replicas)
            for env in src.missing_for(dst.state_vector()):
                dst.receive(env)
    return {"gossip_rounds": rounds, "converge_s": time.perf_counter() - start,
            "state_bytes": replicas[0].state_bytes()}


async def bench_hosts(directory: Path, samples: int) -> float:
    config = StateConfig(sync_interval=1.0, peer_poll_interval=0.1)
    loopback = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    kp_a, kp_b = create_new_key_pair(), create_new_key_pair()
    host_a, host_b = build_host(kp_a), build_host(kp_b)
    latencies = []
    async with host_a.run([loopback]), host_b.run([loopback]), trio.open_nursery() as nursery:
        a = ReplicatedState(host_a, kp_a, data_dir=directory / "a", run_id="b", config=config)
        b = ReplicatedState(host_b, kp_b, data_dir=directory / "b", run_id="b", config=config)
        await nursery.start(a.run)
        await nursery.start(b.run)
        await host_b.connect(info_from_p2p_addr(host_a.get_addrs()[0]))
        for i in range(samples):
            start = trio.current_time()
            await a.set_progress(i, f"h{i}")
            while (b.snapshot()["progress"].get(a.peer_id) or {}).get("round") != i:
                await b.wait_changed()
            latencies.append(trio.current_time() - start)
        nursery.cancel_scope.cancel()
    return statistics.median(latencies) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(prog="lattica-crdt-bench")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--writes", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "envelopes_per_s": round(bench_envelopes(2000)),
            "log_append_fsync_ms_p50": round(bench_log(Path(tmp), 200), 3),
            **{k: round(v, 3) for k, v in bench_convergence(args.replicas, args.writes).items()},
            "replicas": args.replicas,
            "write_to_visible_ms_p50": round(trio.run(bench_hosts, Path(tmp), 30), 2),
        }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
