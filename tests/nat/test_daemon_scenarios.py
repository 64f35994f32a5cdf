"""The five NAT scenarios with real ``lattica join`` daemons in a namespace lab.

Each test builds its own lab (``lattica_lab.nat_daemons``), and reads the outcome the way a
user would: ``lattica peers --json`` / ``lattica status --json`` through ``--data-dir``.

In the two scenarios behind two NATs (``b`` behind a port-preserving NAT, ``c`` behind a
symmetric one or a second port-preserving NAT, both joined through public ``a``), ``lattica
doctor`` must also tell each node what kind of NAT it is behind, from what its peers observe,
and why a peer is relayed. Each report is kept as ``doctor-<node>.json`` in the test's tmp dir.
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

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240), pytest.mark.usefixtures("netlab_available")]


def cli(command: str, data_dir: Path) -> Any:
    out = subprocess.run([sys.executable, "-m", "lattica.cli.main", command, "--data-dir", str(data_dir), "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def peer_via_cli(daemon: LabDaemon, peer_id: str) -> dict[str, Any]:
    return next((p for p in cli("peers", daemon.data_dir) if p["peer_id"] == peer_id), {})


def doctor_reports(daemons: dict[str, LabDaemon], keep: Path) -> dict[str, dict[str, Any]]:
    """``lattica doctor --json`` of every daemon, run at once (each is a CLI start of seconds)."""
    runs = {name: subprocess.Popen([sys.executable, "-m", "lattica.cli.main", "doctor", "--data-dir",
                                    str(d.data_dir), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for name, d in daemons.items()}
    reports = {}
    for name, process in runs.items():
        out, err = process.communicate(timeout=60)
        assert "Traceback" not in err, err
        reports[name] = json.loads(out)
        (keep / f"doctor-{name}.json").write_text(json.dumps(reports[name], indent=2))
    return reports


def peer_finding(report: dict[str, Any], peer_id: str) -> dict[str, Any]:
    short = f"{peer_id[:8]}…{peer_id[-6:]}"
    return next(f for f in report["findings"] if f["check"] == f"peer {short}")


def run(scenario, tmp_path: Path, check) -> ScenarioResult:
    """Run ``scenario``; ``check(result, daemons)`` asserts while the daemons still run."""
    seen: dict[str, Any] = {}

    def hook(result: ScenarioResult, daemons: dict[str, LabDaemon]) -> None:
        seen["checked"] = True
        check(result, daemons)

    result = scenario(tmp_path, before_teardown=hook)
    assert seen.get("checked"), (result, nat_daemons.log_tail(tmp_path))
    return result


def test_public_public_direct(tmp_path):
    def check(r: ScenarioResult, d: dict[str, LabDaemon]) -> None:
        assert r.connected, (r, nat_daemons.log_tail(tmp_path))
        assert r.path == "direct", (r, nat_daemons.log_tail(tmp_path))
        entry = peer_via_cli(d["b"], d["a"].peer_id)
        assert entry["connected"], entry
        assert entry["path"] == "direct", entry
        assert entry["rtt_ms"] is not None, entry
        assert entry["rtt_ms"] > 0, entry
        assert r.details["reachability_a"] == "public", r  # awaited by the scenario
        assert cli("status", d["a"].data_dir)["reachability"] == "public"
        assert cli("status", d["a"].data_dir)["upnp"] == "off"  # the default
        assert cli("status", d["b"].data_dir)["upnp"] == "no gateway"  # --upnp, none answered

    run(nat_daemons.public_public, tmp_path, check)


def test_nat_public_both_directions(tmp_path):
    def check(r: ScenarioResult, d: dict[str, LabDaemon]) -> None:
        logs = nat_daemons.log_tail(tmp_path)
        # NAT -> public: the NAT'd daemon's outbound connection
        assert peer_via_cli(d["b"], d["a"].peer_id)["path"] == "direct", logs
        assert r.details["reachability_b"] == "private", logs  # awaited by the scenario
        assert cli("status", d["b"].data_dir)["reachability"] == "private", logs
        assert cli("status", d["a"].data_dir)["reachability"] == "public", logs
        # public -> NAT: p reached b (which never dials anyone but a) through a's relay, and the
        # hole punch turned that into a direct connection
        assert r.connected, (r, logs)
        entry = peer_via_cli(d["p"], d["b"].peer_id)
        assert entry["connected"], (entry, r, logs)
        assert entry["path"] == "hole-punched", (entry, r, logs)
        assert entry["rtt_ms"] is not None, entry

    run(nat_daemons.nat_public, tmp_path, check)


def test_nat_nat_relayed_then_hole_punched_and_the_doctor_says_so(tmp_path):
    def check(r: ScenarioResult, d: dict[str, LabDaemon]) -> None:
        logs = nat_daemons.log_tail(tmp_path)
        assert r.connected, (r, logs)
        assert r.direct_s is not None, (r, logs)
        assert r.details["reachability"] == ["private", "private"], logs  # awaited by the scenario
        for me, other in (("b", "c"), ("c", "b")):
            assert cli("status", d[me].data_dir)["reachability"] == "private", logs
            entry = peer_via_cli(d[me], d[other].peer_id)
            # "hole-punched" means: first connected through the relay, now directly
            assert entry["connected"], (me, entry, logs)
            assert entry["path"] == "hole-punched", (me, entry, logs)
            assert entry["relay"] is None, entry
            assert entry["rtt_ms"] is not None, entry
        # the doctor tells both cone NAT nodes that they hole-punched
        reports = doctor_reports({name: d[name] for name in ("b", "c")}, tmp_path)
        for me, other in (("b", "c"), ("c", "b")):
            report = reports[me]
            assert report["nat"]["kind"] == "cone", report["nat"]
            finding = peer_finding(report, d[other].peer_id)
            assert finding["detail"].startswith("hole-punched"), finding
            # no warning but, on a loaded machine, a slow RTT
            assert finding["status"] == "ok" or "slow link" in finding["detail"], finding

    run(lambda root, **kw: nat_daemons.nat_nat(root, symmetric=False, **kw), tmp_path, check)


def test_symmetric_nat_stays_relayed_and_trains_and_the_doctor_says_why(tmp_path):
    def check(r: ScenarioResult, d: dict[str, LabDaemon]) -> None:
        logs = nat_daemons.log_tail(tmp_path)
        assert r.connected, (r, logs)
        entry = peer_via_cli(d["b"], d["c"].peer_id)
        assert entry["connected"], (entry, logs)
        assert entry["path"] == "relayed", (entry, logs)
        assert entry["relay"] == d["a"].peer_id, entry
        assert entry["rtt_ms"] is not None, entry
        # the data plane moved the outer-round tensors over the relay
        assert min(r.details["rounds_completed"]) >= 1, (r, logs)
        assert all((n or 0) > 0 for n in r.details["bytes_sent"]), r
        assert r.details["path_after_training"] == "relayed", r
        _doctor_tells_the_symmetric_nat_node_why(doctor_reports(d, tmp_path), d)

    run(lambda root, **kw: nat_daemons.nat_nat(root, symmetric=True, **kw), tmp_path, check)


def _doctor_tells_the_symmetric_nat_node_why(reports: dict[str, dict[str, Any]], d: dict[str, LabDaemon]) -> None:
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


def test_relay_killed_peers_move_to_the_other_relay(tmp_path):
    def check(r: ScenarioResult, d: dict[str, LabDaemon]) -> None:
        logs = nat_daemons.log_tail(tmp_path)
        assert r.details["first_relay"] in (d["r1"].peer_id, d["r2"].peer_id), (r, logs)
        assert r.connected, (r, logs)
        assert r.details["reconnect_s"] is not None, (r, logs)
        survivor = d["r2"] if r.details["first_relay"] == d["r1"].peer_id else d["r1"]
        entry = peer_via_cli(d["b"], d["c"].peer_id)
        assert entry["connected"], (entry, logs)
        assert entry["path"] == "relayed", (entry, logs)
        assert entry["relay"] == survivor.peer_id, (entry, logs)
        relay_addrs = cli("status", d["c"].data_dir)["relay_addrs"]
        assert relay_addrs, relay_addrs
        assert all(survivor.peer_id in a for a in relay_addrs), relay_addrs

    run(nat_daemons.relay_failover, tmp_path, check)
