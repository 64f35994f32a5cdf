"""``lattica doctor`` against real daemons on loopback: through the control socket, and as a
standalone probe before joining."""

from __future__ import annotations

import json

import pytest

from lattica_lab.daemons import DaemonProcess, free_port, run_cli, wait_for

pytestmark = pytest.mark.timeout(120)
ABSENT_PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def doctor(*args: str) -> tuple[int, dict]:
    result = run_cli("doctor", *args, "--json", timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


def findings(report: dict, check: str) -> list[dict]:
    return [f for f in report["findings"] if f["check"] == check or f["check"].startswith(check + " ")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two daemons shared by the tests that only read from them (doctor asks, changes nothing)."""
    tmp_path = tmp_path_factory.mktemp("pair")
    a = DaemonProcess(tmp_path / "a").start()
    b = None
    try:
        a.wait_ready()
        dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{ABSENT_PEER}"  # nothing listens there
        b = DaemonProcess(tmp_path / "b", peers=(a.addr, dead)).start()
        b.wait_ready()
        yield a, b, dead
    finally:
        for d in (a, b):
            if d is not None:
                d.kill()


def test_daemon_report_names_paths_clock_and_the_failed_bootstrap(pair):
    a, b, dead = pair

    def failure_known():
        return any(dead in f["detail"] for f in findings(doctor("--data-dir", str(b.data_dir))[1], "bootstrap"))

    assert wait_for(failure_known, timeout=30), b.log()
    code, report = doctor("--data-dir", str(b.data_dir))
    assert report["mode"] == "daemon"
    assert code == 1
    assert report["healthy"] is False
    [failed] = [f for f in findings(report, "bootstrap") if dead in f["detail"]]
    # the cause from the socket, not the dialer's summary
    assert "Connection refused" in failed["detail"], failed
    assert "nothing listens" in failed["advice"]
    [peer] = [p for p in report["node"]["peers"] if p["peer_id"] == a.peer_id]
    assert peer["connected"]
    assert peer["path"] == "direct"
    assert peer["clock_offset_s"] is not None
    assert abs(peer["clock_offset_s"]) < 1.0
    assert peer["clock_error_s"] is not None
    assert findings(report, "clock")[0]["status"] == "ok"
    assert {f["check"] for f in report["findings"]} >= {"nat", "listen", "dialable", "relay", "disk", "device"}
    assert report["node"]["listen"] == [f"/ip4/127.0.0.1/tcp/{b.port}"]


def test_probe_before_joining_reaches_the_swarm(pair, tmp_path):
    a, _, _ = pair
    port = free_port()
    _code, report = doctor("--data-dir", str(tmp_path / "new"), "--peer", a.addr,
                          "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert report["mode"] == "probe"
    [peer] = report["node"]["peers"]
    assert peer["peer_id"] == a.peer_id
    assert peer["clock_offset_s"] is not None
    assert report["node"]["bootstrap_failures"] == {}
    # a's AutoNAT dialed the probe back on loopback
    # a dials back; other members the probe learned of through a may dial back too
    dialback = report["node"]["dialback"]
    assert dialback.get(a.peer_id) is True, report
    assert all(dialback.values()), report
    assert report["nat"]["kind"] == "public"


def test_probe_reports_an_unusable_address_as_one_finding(tmp_path):
    code, report = doctor("--data-dir", str(tmp_path / "new"), "--peer", "not-a-multiaddr",
                          "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}")
    assert code == 1
    [finding] = findings(report, "bootstrap")
    assert finding["status"] == "problem"
    assert "not-a-multiaddr" in finding["detail"]


def test_machine_only_without_daemon_or_peers(tmp_path):
    code, report = doctor("--data-dir", str(tmp_path / "none"))
    assert (code, report["mode"], report["node"]) == (0, "machine", None)
    assert [f["check"] for f in report["findings"]] == ["disk", "device"]
    human = run_cli("doctor", "--data-dir", str(tmp_path / "none"), timeout=60)
    assert human.returncode == 0
    assert "disk:" in human.stdout
    assert "device:" in human.stdout
