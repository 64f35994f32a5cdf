"""Three real daemons, started through the CLI, find each other through one address."""

from __future__ import annotations

import signal
import time

import pytest

from lattica_lab.daemons import DaemonProcess, cli_json
from lattica_lab.daemons import wait_for as _wait_for


@pytest.fixture
def swarm(tmp_path):
    daemons: list[DaemonProcess] = []
    first = DaemonProcess(tmp_path / "a").start()
    daemons.append(first)
    try:
        first.wait_ready()
        bootstrap = first.addr
        for name in ("b", "c"):
            daemons.append(DaemonProcess(tmp_path / name, peers=(bootstrap,)).start())
        for d in daemons[1:]:
            d.wait_ready()
        yield daemons
    finally:
        for d in daemons:
            d.kill()


def _connected(daemon: DaemonProcess) -> set[str]:
    peers = cli_json("peers", "--data-dir", str(daemon.data_dir))
    for p in peers:
        assert {"peer_id", "addrs", "connected"} <= p.keys()
    return {p["peer_id"] for p in peers if p["connected"]}


def test_three_daemons_discover_each_other_and_notice_a_kill(swarm):
    ids = [d.peer_id for d in swarm]
    for d, me in zip(swarm, ids, strict=True):
        others = set(ids) - {me}
        assert _wait_for(lambda d=d, others=others: _connected(d) >= others, timeout=20), d.log()
    _status_reports_identity_and_peers(swarm)

    victim = swarm[2]
    victim.kill()  # SIGKILL: no goodbye
    for d in swarm[:2]:
        assert _wait_for(lambda d=d: ids[2] not in _connected(d), timeout=15), d.log()
        peers = {p["peer_id"]: p for p in cli_json("peers", "--data-dir", str(d.data_dir))}
        assert peers[ids[2]]["connected"] is False


def test_sigterm_exits_zero_within_five_seconds_and_says_goodbye(swarm):
    leaving = swarm[1]
    leaving_id = leaving.peer_id
    assert _wait_for(lambda: swarm[0].peer_id in _connected(leaving), timeout=15)
    started = time.monotonic()
    leaving.signal(signal.SIGTERM)
    code = leaving.proc.wait(timeout=10)
    assert code == 0, leaving.log()
    assert time.monotonic() - started < 5.0
    assert not (leaving.data_dir / "control.sock").exists()
    peers = {p["peer_id"]: p for p in cli_json("peers", "--data-dir", str(swarm[0].data_dir))}
    assert _wait_for(
        lambda: cli_json("peers", "--data-dir", str(swarm[0].data_dir)) and
        {p["peer_id"]: p for p in cli_json("peers", "--data-dir", str(swarm[0].data_dir))}[leaving_id]["left"],
        timeout=5,
    ), peers


def _status_reports_identity_and_peers(swarm):
    """(on the swarm of the discovery test, before its kill: one swarm start less)"""
    status = cli_json("status", "--data-dir", str(swarm[0].data_dir))
    assert status["peer_id"] == swarm[0].peer_id
    assert status["addrs"][0].endswith(status["peer_id"])
    assert _wait_for(lambda: cli_json("status", "--data-dir", str(swarm[0].data_dir))["connected_peers"] == 2, 15)


def test_new_swarm_prints_join_address_and_peer_reconnects_after_bootstrap_restart(tmp_path):
    bootstrap = DaemonProcess(tmp_path / "boot").start()
    joiner = None
    try:
        bootstrap.wait_ready()
        addr = bootstrap.addr
        assert _wait_for(lambda: f"lattica join --peer {addr}" in bootstrap.log(), timeout=10)
        joiner = DaemonProcess(tmp_path / "joiner", peers=(addr,)).start()
        joiner.wait_ready()
        boot_id = bootstrap.peer_id
        assert _wait_for(lambda: boot_id in _connected(joiner), timeout=15)

        bootstrap.kill()  # the bootstrap peer goes down ...
        assert _wait_for(lambda: boot_id not in _connected(joiner), timeout=15)
        # ... and comes back with the same identity and port: the joiner redials it
        bootstrap = DaemonProcess(tmp_path / "boot", port=bootstrap.port).start()
        bootstrap.wait_ready()
        assert _wait_for(lambda: boot_id in _connected(joiner), timeout=30), joiner.log()
    finally:
        bootstrap.kill()
        if joiner is not None:
            joiner.kill()
