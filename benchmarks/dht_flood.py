"""A DHT record flood from an outsider against a real ``lattica join`` daemon, and its memory.

Starts one daemon on an open run (no secret: anyone may speak Kademlia to it), lets it settle,
takes its resident memory as the baseline, then floods it for ``--seconds`` (default 30) from
``--workers`` concurrent outsiders in this process (``lattica_lab.dht_flood.Flooder``): 16 KB
PUT_VALUEs under fresh ``/lattica/run/…`` keys and ADD_PROVIDERs for fresh content keys, each
worker taking a fresh identity whenever its current one is refused 16 times in a row. The
daemon's RSS is sampled every 0.5 s during the flood and for a few seconds after; its DHT
figures are read from ``lattica status`` and ``/metrics`` at the end.

Target: ``rss_growth_mb`` (peak minus baseline) <= 100. Last line: one JSON object with
``rss_growth_mb``, ``records_accepted`` / ``records_refused`` (as the flooders saw them),
the identities used, the daemon's stored records and bytes, and its refusal counters.

A daemon that does not start, is not a DHT server, or dies during the flood, or a flood that
never reaches it, fails the run: exit status 1 and one line on stderr, no figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from lattica.errors import LatticaError
from lattica_lab.daemons import DaemonProcess, free_port
from lattica_lab.dht_flood import FloodCounts, Flooder

TARGET_GROWTH_MB = 100.0
SETTLE_S = 8.0
AFTER_S = 3.0
SAMPLE_S = 0.5


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise BenchmarkFailed("the daemon has no VmRSS (did it exit?)")


async def flood(target: str, pid: int, *, seconds: float, workers: int) -> tuple[FloodCounts, list[float]]:
    """Flood ``target`` for ``seconds``; the flood's counts and the RSS samples taken meanwhile."""
    counts = FloodCounts()
    samples: list[float] = []
    info = info_from_p2p_addr(Multiaddr(target))
    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(Flooder(target=info, counts=counts).run)
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            samples.append(rss_mb(pid))
            await trio.sleep(SAMPLE_S)
        nursery.cancel_scope.cancel()
    return counts, samples


def scrape(port: int, prefix: str = "lattica_dht_") -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    figures: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            if not name.split("{")[0].endswith("_created"):
                figures[name] = float(value)
    return figures


def run(seconds: float, workers: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics_port = free_port()
        daemon = DaemonProcess(Path(tmp) / "victim", extra_args=("--metrics-addr", f"127.0.0.1:{metrics_port}"))
        daemon.start()
        try:
            daemon.wait_ready(60)
            assert daemon.proc is not None
            pid = daemon.proc.pid
            time.sleep(SETTLE_S)
            dht = daemon.call("status")["dht"]  # type: ignore[index]
            if dht.get("dht_mode") != "server":
                raise BenchmarkFailed(f"the daemon is not a DHT server: {dht}")
            baseline = rss_mb(pid)
            counts, samples = trio.run(lambda: flood(daemon.addr, pid, seconds=seconds, workers=workers))
            for _ in range(int(AFTER_S / SAMPLE_S)):
                time.sleep(SAMPLE_S)
                samples.append(rss_mb(pid))
            if daemon.proc.poll() is not None:
                raise BenchmarkFailed(f"the daemon exited during the flood: {daemon.log()}")
            if counts.identities == 0 or counts.accepted + counts.refused == 0:
                raise BenchmarkFailed("the flood never reached the daemon (no outsider connected)")
            dht = daemon.call("status")["dht"]  # type: ignore[index]
            metrics = scrape(metrics_port)
        finally:
            daemon.stop()
    peak = max(samples)
    return {
        "seconds": seconds,
        "workers": workers,
        "rss_baseline_mb": round(baseline, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_end_mb": round(samples[-1], 1),
        "records_accepted": counts.accepted,
        "records_refused": counts.refused,
        "value_mb_accepted": round(counts.value_bytes_accepted / 2**20, 1),
        "identities": counts.identities,
        "daemon_stored_records": dht.get("stored_records"),
        "daemon_stored_bytes": dht.get("stored_bytes"),
        "daemon_store_refused": dht.get("store_refused"),
        "daemon_store_evicted": dht.get("store_evicted"),
        "metrics": {k: v for k, v in metrics.items() if "refused" in k or "stored" in k or "evicted" in k},
        "target_growth_mb": TARGET_GROWTH_MB,
        "target_met": peak - baseline <= TARGET_GROWTH_MB,
        "rss_growth_mb": round(peak - baseline, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    if args.seconds <= 0 or args.workers < 1:
        parser.error("--seconds must be positive and --workers at least 1")
    try:
        result = run(args.seconds, args.workers)
    except (BenchmarkFailed, LatticaError, TimeoutError, RuntimeError, OSError) as exc:
        print(f"dht flood benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    print(
        f"flooded {result['seconds']:.0f} s with {result['workers']} workers over {result['identities']} identities: "
        f"{result['records_accepted']} accepted, {result['records_refused']} refused; daemon RSS "
        f"{result['rss_baseline_mb']} -> peak {result['rss_peak_mb']} MB"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
