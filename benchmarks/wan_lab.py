"""The WAN lab's fidelity and cost: RTT and rate as TCP sees them, the delay line's CPU and ceiling.

Run as root: ``python benchmarks/wan_lab.py`` (about a minute). Builds two sites with
``lattica_lab.wan.WanLab`` (4 hosts each) and, relinking them for each case, measures with
``lattica_lab.wan_probe``:

- ``rtt``: per emulated RTT, the median TCP connect time and ping-pong time (ms), and the
  ping-pong's 90th percentile (timer wake-ups on a loaded machine run late now and then);
- ``rate``: per link rate (50 ms RTT), the goodput of one bulk TCP flow after slow start;
- ``cost``: the delay line's CPU (% of one core) while carrying one flow at the given rate, the
  reads per second (GSO packets) and wire segments per second it handled;
- ``ceiling``: on a link without rate limit (50 ms RTT), the goodput of 4 parallel TCP flows
  between 4 host pairs, and the 64-byte UDP packet rate the line forwards when 4 hosts flood
  it, each with the line's CPU and its CPU time per packet read (``cpu_us_per_read``; one core
  divided by it is the line's packet-rate ceiling).

The last line is JSON with those keys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.wan import WanLab, wan_unavailable_reason

PROBE = [sys.executable, "-m", "lattica_lab.wan_probe"]


def _probe(lab: WanLab, host, mode: str, *args: str) -> dict:
    return json.loads(lab.run_in(host, [*PROBE, mode, *args], timeout=120).splitlines()[-1])


def _relink(lab: WanLab, rtt_ms: float, mbit: float | None) -> None:
    if lab.links:
        lab.unlink("a", "b")
    lab.link("a", "b", rtt_ms=rtt_ms, mbit=mbit)


def _line_usage(lab: WanLab, run) -> tuple[object, dict]:
    before = lab.link_stats("a", "b")
    started = time.monotonic()
    result = run()
    wall = time.monotonic() - started
    after = lab.link_stats("a", "b")
    reads = sum(after[d]["packets"] - before[d]["packets"] for d in ("a_to_b", "b_to_a"))
    segments = sum(after[d]["segments"] - before[d]["segments"] for d in ("a_to_b", "b_to_a"))
    return result, {
        "cpu_pct": round(100 * (after["cpu_s"] - before["cpu_s"]) / wall, 1),
        "reads_per_s": round(reads / wall), "segments_per_s": round(segments / wall),
        "dropped": after["a_to_b"]["dropped"] - before["a_to_b"]["dropped"],
        "cpu_us_per_read": round(1e6 * (after["cpu_s"] - before["cpu_s"]) / max(reads, 1), 1),
    }


def _parallel(jobs) -> list:
    results: list = [None] * len(jobs)

    def one(i: int) -> None:
        results[i] = jobs[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", default="20,50,100,200")
    parser.add_argument("--rates", default="10,50,200")
    parser.add_argument("--seconds", type=float, default=6.0, help="per bulk measurement")
    args = parser.parse_args()
    reason = wan_unavailable_reason()
    if reason:
        print(f"wan_lab: cannot build the lab: {reason}", file=sys.stderr)
        return 1
    out: dict = {"rtt": {}, "rate": {}, "cost": {}, "ceiling": {}}
    with WanLab() as lab:
        a, b = lab.add_site("a", hosts=4), lab.add_site("b", hosts=4)
        for host in b.hosts:
            lab.spawn(host, [*PROBE, "serve"]).wait_for(lambda e: e.get("event") == "listening", 15)
        server = b.hosts[0].ip
        lab.link(a, b, rtt_ms=20)
        for rtt in (float(x) for x in args.rtts.split(",")):
            _relink(lab, rtt, 100)
            r = _probe(lab, a.hosts[0], "rtt", "--host", server, "--connects", "15", "--pings", "40")
            row = {"connect_ms": round(r["connect_median_ms"], 2), "ping_ms": round(r["ping_median_ms"], 2),
                   "ping_p90_ms": round(statistics.quantiles(r["ping_ms"], n=10)[-1], 2)}
            out["rtt"][f"{rtt:g}"] = row
            print(f"rtt {rtt:g} ms: {row}", flush=True)
        for mbit in (float(x) for x in args.rates.split(",")):
            _relink(lab, 50, mbit)
            bulk, usage = _line_usage(lab, lambda: _probe(
                lab, a.hosts[0], "bulk", "--host", server, "--seconds", str(args.seconds), "--warmup", "2"))
            out["rate"][f"{mbit:g}"] = round(bulk["mbit"], 1)
            out["cost"][f"{mbit:g}"] = usage
            print(f"rate {mbit:g} Mbit/s: goodput {bulk['mbit']:.1f}, line {usage}", flush=True)
        _relink(lab, 50, None)
        flows, usage = _line_usage(lab, lambda: _parallel([
            (lambda i=i: _probe(lab, a.hosts[i], "bulk", "--host", b.hosts[i].ip,
                                "--seconds", str(args.seconds), "--warmup", "2"))
            for i in range(4)]))
        out["ceiling"]["tcp_4_flows_mbit"] = round(sum(f["mbit"] for f in flows), 1)
        out["ceiling"]["tcp_line"] = usage
        print(f"ceiling, 4 TCP flows: {out['ceiling']['tcp_4_flows_mbit']} Mbit/s, line {usage}", flush=True)
        floods, usage = _line_usage(lab, lambda: _parallel([
            (lambda i=i: _probe(lab, a.hosts[i], "flood", "--host", b.hosts[i].ip,
                                "--seconds", str(args.seconds), "--size", "64"))
            for i in range(4)]))
        out["ceiling"]["udp_sent_pps"] = round(sum(f["sent_pps"] for f in floods))
        out["ceiling"]["udp_forwarded_pps"] = round(sum(f["received_pps"] for f in floods))
        out["ceiling"]["udp_line"] = usage
        print(f"ceiling, UDP flood from 4 hosts: sent {out['ceiling']['udp_sent_pps']}/s, "
              f"arrived {out['ceiling']['udp_forwarded_pps']}/s, line {usage}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
