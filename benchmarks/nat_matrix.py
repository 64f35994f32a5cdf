"""NAT traversal matrix in the namespace lab; the last line is one JSON object.

Run as root: ``python benchmarks/nat_matrix.py``. Each scenario builds and tears down its own
lab. Columns: scenario, connected, final path, seconds to first connection, seconds to direct.
"""

from __future__ import annotations

import json
import sys

from lattica.net.nat._lab_scenarios import SCENARIOS, ScenarioResult
from lattica.testing.netlab import lab_unavailable_reason


def main() -> int:
    reason = lab_unavailable_reason()
    if reason:
        print(json.dumps({"error": f"NAT lab unavailable: {reason}"}))
        return 2
    results: list[ScenarioResult] = []
    for name, scenario in SCENARIOS.items():
        try:
            results.append(scenario())
        except Exception as exc:
            r = ScenarioResult(name, direct_possible=name not in ("nat<->symmetric-nat",
                                                                  "relay-failover"))
            r.details["error"] = repr(exc)[:300]
            results.append(r)
    print(f"{'scenario':<22}{'connected':<11}{'path':<14}{'connect_s':<11}{'direct_s':<10}")
    for r in results:
        print(f"{r.scenario:<22}{r.connected!s:<11}{r.path!s:<14}{r.connect_s!s:<11}"
              f"{r.direct_s!s:<10}")
    connect_times = [r.connect_s for r in results if r.connect_s is not None]
    summary = {
        "scenarios": len(results),
        "connected": sum(r.connected for r in results),
        "direct_ok": all(r.direct_s is not None for r in results if r.direct_possible),
        "max_connect_s": max(connect_times) if connect_times else None,
        "matrix": [
            {"scenario": r.scenario, "connected": r.connected, "path": r.path,
             "connect_s": r.connect_s, "direct_s": r.direct_s} for r in results
        ],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
