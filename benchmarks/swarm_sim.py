"""The product's protocol cores at 100-1,000 members, simulated (``lattica_lab.sim``).

    nice -n 10 .venv/bin/python benchmarks/swarm_sim.py                  # sizes 100, 300, 1000
    nice -n 10 .venv/bin/python benchmarks/swarm_sim.py --sizes 100 --rounds 20

For each size, ``lattica_lab.sim.scenario.run``: real replicas and sessions, DHT walks, gossip
groups, churn of ``--churn`` of the members per 10 minutes of virtual time, ``--rounds`` rounds
of ``--round-s`` virtual seconds. The last line is one JSON object: ``sizes`` and, per size
(lists in the order of ``sizes``), ``state_bytes_per_member``, ``state_sync_bytes_per_peer_per_round``
(and per member), ``dht_lookup_success`` and ``dht_hops_p99`` (worst size), ``state_growth_100_vs_10_rounds``
(worst size; the state averaged over 4 rounds, ``state_growth_instant`` at one instant),
``gossip_consensus_rounds`` and ``join_state_s`` (largest size), ``targets_met``.
"""

from __future__ import annotations

import argparse
import json
import sys

import _checkout  # noqa: F401  (puts the checkout root on sys.path)

from lattica_lab.sim.scenario import Scenario, run

TARGETS = {
    "state_sync_bytes_per_member_per_peer_per_round": 512,
    "state_bytes_per_member": 2048,
    "state_growth_100_vs_10_rounds": 1.2,
    "dht_hops_p99": 10,
    "gossip_consensus_rounds": 20,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,300,1000")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--round-s", type=float, default=60.0)
    parser.add_argument("--churn", type=float, default=0.10, help="share of the members replaced per 10 minutes")
    parser.add_argument("--degree", type=int, default=64, help="connected peers per member")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = []
    for size in sizes:
        result = run(Scenario(size=size, rounds=args.rounds, round_s=args.round_s, churn_per_10min=args.churn,
                              degree=args.degree, seed=args.seed))
        print(json.dumps(result), flush=True)
        results.append(result)
    summary = summarize(sizes, results)
    print(json.dumps(summary))
    return 0 if summary["targets_met"] else 1


def summarize(sizes: list[int], results: list[dict[str, object]]) -> dict[str, object]:
    def each(key: str) -> list[object]:
        return [r[key] for r in results]

    def numbers(key: str) -> list[float]:
        return [float(v) for v in each(key) if isinstance(v, int | float)]

    largest = results[-1]
    hops = [h for h in each("dht_hops_p99") if isinstance(h, int)]
    consensus = largest["gossip_consensus_rounds"]
    summary: dict[str, object] = {
        "sizes": sizes,
        "state_bytes_per_member": each("state_bytes_per_member"),
        "state_growth_100_vs_10_rounds": max(numbers("state_growth_100_vs_10_rounds")),
        "state_growth_instant": max(numbers("state_growth_instant")),
        "state_sync_bytes_per_peer_per_round": each("state_sync_bytes_per_peer_per_round"),
        "state_sync_bytes_per_member_per_peer_per_round": each("state_sync_bytes_per_member_per_peer_per_round"),
        "heartbeat_interval_s": each("heartbeat_interval_s"),
        "dht_lookup_success": min(numbers("dht_lookup_success")),
        "dht_hops_p99": max(hops) if hops else None,
        "gossip_consensus_rounds": consensus,
        "join_state_s": largest["join_state_s"],
        "wall_s": round(sum(numbers("wall_s")), 1),
    }
    summary["targets_met"] = (
        all(v <= TARGETS["state_sync_bytes_per_member_per_peer_per_round"]
            for v in numbers("state_sync_bytes_per_member_per_peer_per_round"))
        and all(v <= TARGETS["state_bytes_per_member"] for v in numbers("state_bytes_per_member"))
        and max(numbers("state_growth_100_vs_10_rounds")) <= TARGETS["state_growth_100_vs_10_rounds"]
        and min(numbers("dht_lookup_success")) >= 0.99
        and bool(hops) and max(hops) <= TARGETS["dht_hops_p99"]
        and isinstance(consensus, int) and consensus <= TARGETS["gossip_consensus_rounds"]
    )
    return summary


if __name__ == "__main__":
    sys.exit(main())
