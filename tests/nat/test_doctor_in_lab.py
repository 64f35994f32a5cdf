"""``lattica doctor`` on daemons behind real NATs (namespace lab, ``lattica_lab.nat_daemons``).

``b`` sits behind a port-preserving NAT and ``c`` behind a symmetric one (or a second
port-preserving NAT); both join through public ``a``. The doctor must tell each node what kind
of NAT it is behind, from what its peers observe, and why a peer is relayed.
Each report is also kept as ``doctor-<node>.json`` in the test's tmp dir.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lattica_lab import nat_daemons
from lattica_lab.nat_daemons import LabDaemon, ScenarioResult

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300), pytest.mark.usefixtures("netlab_available")]


def doctor(daemon: LabDaemon, keep: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "lattica.cli.main", "doctor", "--data-dir", str(daemon.data_dir),
                          "--json"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    keep.write_text(json.dumps(report, indent=2))
    return report


def peer_finding(report: dict[str, Any], peer_id: str) -> dict[str, Any]:
    short = f"{peer_id[:8]}…{peer_id[-6:]}"
    return next(f for f in report["findings"] if f["check"] == f"peer {short}")


def run(tmp_path: Path, *, symmetric: bool, check) -> None:
    seen: dict[str, bool] = {}

    def hook(result: ScenarioResult, daemons: dict[str, LabDaemon]) -> None:
        assert result.connected, (result, nat_daemons.log_tail(tmp_path))
        check({name: doctor(daemons[name], tmp_path / f"doctor-{name}.json") for name in ("a", "b", "c")}, daemons)
        seen["checked"] = True

    nat_daemons.nat_nat(tmp_path, symmetric=symmetric, before_teardown=hook)
    assert seen.get("checked")


def test_symmetric_nat_node_is_told_it_is_relayed_and_why(tmp_path):
    def check(reports: dict[str, dict[str, Any]], d: dict[str, LabDaemon]) -> None:
        a, b, c = reports["a"], reports["b"], reports["c"]
        assert a["nat"]["kind"] == "public", a["nat"]
        assert b["nat"]["kind"] == "cone", b["nat"]
        assert c["nat"]["kind"] == "symmetric", c["nat"]
        assert "rewrites ports" in c["nat"]["evidence"]
        relayed = peer_finding(c, d["b"].peer_id)
        assert relayed["status"] == "warn", relayed
        assert "relayed via" in relayed["detail"], relayed
        assert "symmetric NAT" in relayed["detail"], relayed
        assert "--announce" in relayed["advice"], relayed
        # the relay is a's reservation, and the path to a is direct with an RTT and a clock figure
        assert c["node"]["relay_addrs"], c["node"]
        assert next(f for f in c["findings"] if f["check"] == "relay")["status"] == "ok"
        to_a = next(p for p in c["node"]["peers"] if p["peer_id"] == d["a"].peer_id)
        assert to_a["path"] == "direct", to_a
        assert to_a["rtt_ms"] is not None, to_a
        assert to_a["clock_offset_s"] is not None, to_a
        # b, behind the port-preserving NAT, is told the other side is the reason
        assert "relayed" in peer_finding(b, d["c"].peer_id)["detail"]
        # the two trained together over the relay: the last transfer's rate is known to one of them
        transfers = [p["last_transfer_mbit_s"] for r in (b, c) for p in r["node"]["peers"]]
        assert any(t for t in transfers), transfers

    run(tmp_path, symmetric=True, check=check)


def test_cone_nat_nodes_are_told_they_hole_punched(tmp_path):
    def check(reports: dict[str, dict[str, Any]], d: dict[str, LabDaemon]) -> None:
        for me, other in (("b", "c"), ("c", "b")):
            report = reports[me]
            assert report["nat"]["kind"] == "cone", report["nat"]
            finding = peer_finding(report, d[other].peer_id)
            assert finding["detail"].startswith("hole-punched"), finding
            # no warning but, on a loaded machine, a slow RTT
            assert finding["status"] == "ok" or "slow link" in finding["detail"], finding

    run(tmp_path, symmetric=False, check=check)
