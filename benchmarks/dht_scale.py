"""Provider lookups on a DHT of N real libp2p hosts on 127.0.0.1, spread over worker processes.

Layout: ``--workers`` processes (default: one per core), each running many hosts in one trio
loop (an idle host in its own process would cost ~84 MB; here they share one interpreter).
The parent only orchestrates, over JSON lines on the workers' stdin/stdout, and kills the
workers it started (by their PIDs) when it ends.

The network grows 25 -> 50 -> 100 -> 200. A joining node dials one random node that was
already in the network (in any worker) and looks itself up (``LatticaDHT.bootstrap``).
After each growth step, ``--lookups`` times: a random node provides a fresh random key, a
random other node walks the DHT for it (``find_providers(enough=1, include_local=False)``,
so a seeker that happens to store the record still walks), and we record success, the hop
at which the first provider record came back (routing-table seeds are hop 1), and the wall
time of the walk. The last line of output is one JSON object.

A lookup that finds no provider (in its 30 s) is a measured failure (``success_rate``). A growth
step that does not finish — a join that fails or times out, a worker that exits — fails the run:
exit status 1 and one line on stderr, no figures (lookups on a partly joined network would be
reported as if it were whole).

py-libp2p's AutoConnector is stopped on every host (``--keep-auto-connector`` leaves it on):
it dials every peer in the peerstore up to ~200 connections, which with DHT-learned addresses
is O(N^2) handshakes and swamps two cores long before N = 200.

Usage: python benchmarks/dht_scale.py [--sizes 25,50,100,200] [--lookups 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack

import multiaddr
import trio

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
JOIN_CONCURRENCY = 6
JOIN_TIMEOUT_S = 60.0
WORKER_SCRIPT = os.path.abspath(__file__)


class BenchmarkFailed(RuntimeError):
    """A growth step did not finish: the benchmark reports no figures."""


def check_grown(n: int, replies: dict[int, dict]) -> None:
    """Raise ``BenchmarkFailed`` if any worker's joins failed while growing to ``n`` nodes."""
    failed = {i: r.get("failed_joins", []) for i, r in replies.items() if r.get("failed_joins")}
    if failed:
        count = sum(len(f) for f in failed.values())
        first = next(iter(failed.values()))[0]
        raise BenchmarkFailed(f"growing to {n} nodes: {count} join(s) did not finish (first: {first})")


# -- worker process ------------------------------------------------------------------------
class Worker:
    """Hosts in this process; answers one JSON command per stdin line."""

    def __init__(self, stack: AsyncExitStack, *, quiet_hosts: bool) -> None:
        from lattica.dht import DHTConfig

        self._stack = stack
        self._quiet_hosts = quiet_hosts
        self._config = DHTConfig(query_timeout=10.0)
        self.hosts: list = []
        self.dhts: list = []

    async def grow(self, contacts: list[list]) -> dict:
        from libp2p.crypto.ed25519 import create_new_key_pair

        from lattica.dht import LatticaDHT
        from lattica.net.host import build_host

        listen = multiaddr.Multiaddr(LOOPBACK)
        new = []
        for _ in contacts:
            host = build_host(create_new_key_pair(), listen_addrs=[listen])
            await self._stack.enter_async_context(host.run([listen]))
            if self._quiet_hosts:
                # py-libp2p's AutoConnector dials every peer in the peerstore until it holds
                # ~200 connections; with DHT-learned addresses that is O(N^2) handshakes.
                await host.get_network().auto_connector.stop()
            new.append((host, LatticaDHT(host, config=self._config)))
        limiter = trio.CapacityLimiter(JOIN_CONCURRENCY)
        failed: list[str] = []
        async with trio.open_nursery() as nursery:
            for (host, dht), contact in zip(new, contacts, strict=True):
                if contact:
                    nursery.start_soon(self._join, host, dht, contact, limiter, failed)
        for host, dht in new:
            self.hosts.append(host)
            self.dhts.append(dht)
        return {"peers": [_info_json(h) for h, _ in new], "failed_joins": failed}

    async def _join(self, host, dht, contact, limiter, failed: list[str]) -> None:
        async with limiter:
            with trio.move_on_after(JOIN_TIMEOUT_S) as scope:
                try:
                    await host.connect(_info_from_json(contact))
                    await dht.bootstrap()
                except Exception as exc:  # noqa: BLE001 - network: any failure to join is a failed join, counted
                    failed.append(f"join failed: {exc!r}"[:200])
            if scope.cancelled_caught:
                failed.append(f"join took over {JOIN_TIMEOUT_S:.0f} s")

    async def provide(self, index: int, key: str) -> dict:
        return {"ok": await self.dhts[index].provide(bytes.fromhex(key))}

    async def find(self, index: int, key: str) -> dict:
        started = time.perf_counter()
        with trio.move_on_after(30):
            result = await self.dhts[index].find_providers(
                bytes.fromhex(key), enough=1, include_local=False
            )
            return {
                "providers": [str(p.peer_id) for p in result.providers],
                "hops": result.hops,
                "ms": (time.perf_counter() - started) * 1000,
            }
        return {"providers": [], "hops": None, "ms": None}

    def stats(self) -> dict:
        return {
            "tables": [d.routing_table_size() for d in self.dhts],
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def _info_json(host) -> list:
    return [host.get_id().to_base58(), [str(a) for a in host.get_addrs()]]


def _info_from_json(info: list):
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    return PeerInfo(ID.from_base58(info[0]), [multiaddr.Multiaddr(a) for a in info[1]])


async def worker_main() -> None:
    stdin = trio.wrap_file(sys.stdin)
    async with AsyncExitStack() as stack:
        worker = Worker(stack, quiet_hosts="--keep-auto-connector" not in sys.argv)
        while line := await stdin.readline():
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            reply = worker.stats() if op == "stats" else await getattr(worker, op)(**cmd)
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


# -- orchestrating parent -------------------------------------------------------------------
class WorkerProcess:
    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buf = b""
        self.count = 0

    async def call(self, **cmd) -> dict:
        await self.process.stdin.send_all((json.dumps(cmd) + "\n").encode())
        while b"\n" not in self._buf:
            chunk = await self.process.stdout.receive_some(1 << 16)
            if not chunk:
                raise RuntimeError(f"worker {self.process.pid} exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def call_or_fail(self, **cmd) -> dict:
        try:
            return await self.call(**cmd)
        except RuntimeError as exc:
            raise BenchmarkFailed(str(exc)) from None


async def grow(workers: list[WorkerProcess], peers: list, n: int, rng: random.Random) -> None:
    """Add nodes round-robin over workers; each dials a node that existed before this step."""
    if not peers:  # the very first node has nobody to dial
        first = await workers[0].call_or_fail(op="grow", contacts=[None])
        peers.append((0, 0, first["peers"][0]))
        workers[0].count = 1
    existing = [info for _, _, info in peers]
    plan: list[list] = [[] for _ in workers]
    for k in range(n - len(peers)):
        plan[k % len(workers)].append(rng.choice(existing))
    replies: dict[int, dict] = {}

    async def one(i: int) -> None:
        try:
            replies[i] = await workers[i].call(op="grow", contacts=plan[i])
        except RuntimeError as exc:  # raised after the nursery, not as an exception group
            replies[i] = {"failed_joins": [str(exc)]}

    async with trio.open_nursery() as nursery:
        for i, contacts in enumerate(plan):
            if contacts:
                nursery.start_soon(one, i)
    check_grown(n, replies)
    for i in sorted(replies):
        for info in replies[i]["peers"]:
            peers.append((i, workers[i].count, info))
            workers[i].count += 1


async def measure(workers, peers, lookups: int, rng: random.Random) -> dict:
    hops, times, ok = [], [], 0
    for _ in range(lookups):
        (pw, pi, pinfo), (sw, si, _) = rng.sample(peers, 2)
        key = os.urandom(34).hex()
        await workers[pw].call_or_fail(op="provide", index=pi, key=key)
        await trio.sleep(0.05)  # ADD_PROVIDER is fire-and-forget; let it land
        answer = await workers[sw].call_or_fail(op="find", index=si, key=key)
        if pinfo[0] in answer["providers"]:
            ok += 1
            hops.append(answer["hops"])
            times.append(answer["ms"])
    return {
        "n": len(peers),
        "success_rate": ok / lookups,
        "median_hops": statistics.median(hops) if hops else None,
        "mean_hops": round(statistics.fmean(hops), 2) if hops else None,
        "max_hops": max(hops) if hops else None,
        "median_lookup_ms": round(statistics.median(times), 1) if times else None,
    }


async def parent_main(
    sizes: list[int], lookups: int, n_workers: int, seed: int, keep_auto_connector: bool
) -> dict:
    rng = random.Random(seed)
    cmd = [sys.executable, WORKER_SCRIPT, "--worker"]
    if keep_auto_connector:
        cmd.append("--keep-auto-connector")
    procs = []
    try:
        for _ in range(n_workers):
            procs.append(
                await trio.lowlevel.open_process(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
            )
        workers = [WorkerProcess(p) for p in procs]
        peers: list = []
        rows = []
        for n in sizes:
            t0 = time.perf_counter()
            await grow(workers, peers, n, rng)
            setup_s = round(time.perf_counter() - t0, 1)
            row = await measure(workers, peers, lookups, rng)
            stats = [await w.call_or_fail(op="stats") for w in workers]
            tables = [t for s in stats for t in s["tables"]]
            row.update(
                setup_s=setup_s,
                median_routing_table=statistics.median(tables),
                worker_rss_mb=[round(s["rss_mb"]) for s in stats],
            )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        for w in workers:
            await w.process.stdin.send_all(b'{"op": "quit"}\n')
        with trio.move_on_after(10):
            for p in procs:
                await p.wait()
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()  # only the workers this run started, by their PIDs
    return {
        "n": rows[-1]["n"],
        "success_rate": rows[-1]["success_rate"],
        "sizes": [r["n"] for r in rows],
        "median_hops": [r["median_hops"] for r in rows],
        "median_lookup_ms": [r["median_lookup_ms"] for r in rows],
        "success_rates": [r["success_rate"] for r in rows],
        "mean_hops": [r["mean_hops"] for r in rows],
        "max_hops": [r["max_hops"] for r in rows],
        "median_routing_table": [r["median_routing_table"] for r in rows],
        "setup_s": [r["setup_s"] for r in rows],
        "lookups_per_n": lookups,
        "processes": n_workers,
        "hosts_per_process": -(-rows[-1]["n"] // n_workers),
        "worker_rss_mb": rows[-1]["worker_rss_mb"],
        "auto_connector": keep_auto_connector,
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.CRITICAL)
    if "--worker" in sys.argv:
        trio.run(worker_main)
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,50,100,200")
    parser.add_argument("--lookups", type=int, default=30)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--keep-auto-connector",
        action="store_true",
        help="leave py-libp2p's AutoConnector on (it dials every known peer: O(N^2))",
    )
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 2 or args.lookups < 1 or args.workers < 1:
        parser.error("--sizes must be at least 2, --lookups and --workers at least 1")
    try:
        result = trio.run(
            parent_main, sizes, args.lookups, args.workers, args.seed, args.keep_auto_connector
        )
    except BenchmarkFailed as exc:
        print(f"dht_scale benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(result), flush=True)
