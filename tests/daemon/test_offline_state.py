"""``lattica state`` on a stopped daemon's data dir: the stored state, read without writing."""

from __future__ import annotations

import json

from lattica_lab.daemons import DaemonProcess, run_cli


def test_state_of_a_stopped_daemon_comes_from_its_data_dir(tmp_path):
    daemon = DaemonProcess(tmp_path / "node", extra_args=("--run-id", "offline-run")).start()
    try:
        daemon.wait_ready(timeout=60)
        peer_id = daemon.peer_id
        live = json.loads(run_cli("state", "--data-dir", str(daemon.data_dir), "--json").stdout)
        assert peer_id in live["members"]
    finally:
        assert daemon.stop() == 0
    log = daemon.data_dir / "state-offline-run.log"
    before = log.read_bytes()

    result = run_cli("state", "--data-dir", str(daemon.data_dir), "--json")
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)
    assert peer_id in stored["members"]
    assert stored["live"] == []
    assert stored["node"]["offline"] is True
    assert log.read_bytes() == before  # read only

    table = run_cli("state", "--data-dir", str(daemon.data_dir))
    assert table.returncode == 0, table.stderr
    assert "no daemon running" in table.stdout
    assert peer_id[:8] in table.stdout


def test_state_without_daemon_or_stored_state_is_one_line(tmp_path):
    result = run_cli("state", "--data-dir", str(tmp_path))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "no daemon" in result.stderr
    result = run_cli("state", "--data-dir", str(tmp_path), "--run-id", "other")
    assert result.returncode != 0
    assert "no daemon" in result.stderr


def test_several_stored_runs_need_a_run_id(tmp_path):
    for run in ("a", "b"):
        (tmp_path / f"state-{run}.log").write_bytes(b"")
    result = run_cli("state", "--data-dir", str(tmp_path), "--json")
    assert result.returncode != 0
    assert "--run-id" in result.stderr
    chosen = run_cli("state", "--data-dir", str(tmp_path), "--json", "--run-id", "b")
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout)["node"]["run_id"] == "b"
