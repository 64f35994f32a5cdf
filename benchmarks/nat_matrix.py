"""NAT traversal matrix: real ``lattica join`` daemons in the namespace lab; last line is JSON.

Run as root: ``python benchmarks/nat_matrix.py``. Each scenario builds and tears down its own
lab (``lattica_lab.nat_daemons``). Columns: scenario, connected, final path, seconds to
first connection, seconds to a direct (or hole-punched) path. Both times run from the moment
the dialing daemon is up (control socket answers) to the first poll of its peer table (0.1 s)
showing the state, so they include discovery: the AutoNAT verdict, the relay reservation and
the relay address reaching the other side through the replicated state and peer exchange.
``relay-failover`` adds ``reconnect_s``: from killing the relay in use to being connected
again through the other one.

Summary keys: ``scenarios``, ``connected`` (count), ``direct_ok`` (every scenario that allows a
direct path got one), ``max_connect_s``. Targets: all connected, direct_ok, max_connect_s <= 5.

A scenario that fails to connect is a row of the matrix. A scenario that does not finish (its
lab or daemons raised) fails the run after the table: exit status 1, one line on stderr, no
summary (its figures would be computed over a partial matrix).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.nat_daemons import SCENARIOS, ScenarioResult
from lattica_lab.netlab import lab_unavailable_reason

NOT_DIRECT = ("nat<->symmetric-nat", "relay-failover")


def run_one(name: str, root: Path) -> ScenarioResult:
    try:
        return SCENARIOS[name](root)
    except Exception as exc:  # noqa: BLE001 - a broken scenario is a row in the matrix, not a crash
        result = ScenarioResult(name, direct_possible=name not in NOT_DIRECT)
        result.details["error"] = repr(exc)[:300]
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(SCENARIOS), help="run just these")
    args = parser.parse_args()
    reason = lab_unavailable_reason()
    if reason:
        print(json.dumps({"error": f"NAT lab unavailable: {reason}"}))
        return 2
    results: list[ScenarioResult] = []
    with tempfile.TemporaryDirectory(prefix="lattica-nat-") as tmp:
        for index, name in enumerate(args.only or SCENARIOS):
            results.append(run_one(name, Path(tmp) / str(index)))
            print(f"# {name}: {json.dumps(results[-1].details, default=str)}", file=sys.stderr)
    print(f"{'scenario':<22}{'connected':<11}{'path':<14}{'connect_s':<11}{'direct_s':<10}reconnect_s")
    for r in results:
        print(f"{r.scenario:<22}{r.connected!s:<11}{r.path!s:<14}{r.connect_s!s:<11}"
              f"{r.direct_s!s:<10}{r.details.get('reconnect_s', '-')}")
    try:
        summary = summarize(results)
    except ScenarioUnfinished as exc:
        print(f"nat matrix failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


class ScenarioUnfinished(RuntimeError):
    """A scenario raised instead of finishing: the matrix has no summary."""


def summarize(results: list[ScenarioResult]) -> dict:
    """The summary JSON; raises ``ScenarioUnfinished`` naming the scenarios that raised."""
    broken = [f"{r.scenario} ({r.details['error']})" for r in results if "error" in r.details]
    if broken:
        raise ScenarioUnfinished(f"scenario(s) did not finish: {'; '.join(broken)}")
    if not results:
        raise ScenarioUnfinished("no scenario ran")
    connect_times = [r.connect_s for r in results if r.connect_s is not None]
    return {
        "scenarios": len(results),
        "connected": sum(r.connected for r in results),
        "direct_ok": all(r.direct_s is not None for r in results if r.direct_possible),
        "max_connect_s": max(connect_times) if connect_times else None,
        "matrix": [
            {"scenario": r.scenario, "connected": r.connected, "path": r.path,
             "connect_s": r.connect_s, "direct_s": r.direct_s,
             **({"reconnect_s": r.details["reconnect_s"]} if "reconnect_s" in r.details else {}),
             **({"error": r.details["error"]} if "error" in r.details else {})}
            for r in results
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
