"""Config precedence, key persistence, and every bad-input case: one line, non-zero exit."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest

from lattica.cli.settings import build_node_config
from lattica.config import NodeConfig
from lattica.errors import ConfigError
from lattica.testing.daemons import free_port, run_cli


def _one_line_error(result) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lattica: error:"), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_key_is_created_0600_and_stable(tmp_path):
    first = run_cli("id", "--data-dir", str(tmp_path), "--json")
    second = run_cli("id", "--data-dir", str(tmp_path), "--json")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    key = tmp_path / "identity.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert '"12D3KooW' in first.stdout


def test_precedence_flags_over_env_over_file(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text('run_id = "from-file"\nlog_level = "info"\nmetrics_addr = "127.0.0.1:9500"\n[train]\nrounds = 3\n')
    env = {"LATTICA_RUN_ID": "from-env", "LATTICA_LOG_LEVEL": "error", "LATTICA_TRAIN_ROUNDS": "5"}
    merged = build_node_config(
        flags={"data_dir": tmp_path, "run_id": "from-flag"}, config_path=config, environ=env
    )
    assert isinstance(merged, NodeConfig)
    assert merged.run_id == "from-flag"
    assert merged.log_level == "error"
    assert merged.metrics_addr == "127.0.0.1:9500"
    assert merged.train is not None
    assert merged.train.rounds == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        merged.run_id = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ('bogus = 1\n', {}, "unknown key"),
        ('[train]\nwhat = 1\n', {}, "unknown key"),
        ('listen = "/ip4/1.2.3"\n', {}, "malformed multiaddr"),
        ("run_id = 'x'\n[[", {}, "not valid TOML"),
        ("", {"LATTICA_NOPE": "1"}, "unknown variable"),
        ("", {"LATTICA_TRAIN_ROUNDS": "many"}, "invalid value"),
        ("[train]\nrounds = -2\n", {}, "positive integer"),
    ],
)
def test_bad_config_is_a_config_error(tmp_path, toml, env, message):
    config = tmp_path / "node.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        build_node_config(flags={"data_dir": tmp_path}, config_path=config, environ=env)


def test_malformed_peer_multiaddr_one_line(tmp_path):
    line = _one_line_error(run_cli("join", "--data-dir", str(tmp_path), "--peer", "/ip4/300.1.1.1/tcp/x"))
    assert "multiaddr" in line


def test_peer_without_peer_id_one_line(tmp_path):
    line = _one_line_error(run_cli("join", "--data-dir", str(tmp_path), "--peer", "/ip4/127.0.0.1/tcp/4001"))
    assert "/p2p/" in line


def test_unknown_config_key_one_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("colour = 'blue'\n")
    _one_line_error(run_cli("join", "--data-dir", str(tmp_path), "--config", str(config)))


def test_port_in_use_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = _one_line_error(
            run_cli("join", "--data-dir", str(tmp_path), "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--metrics-addr", "off")
        )
    assert "in use" in line


def test_wrong_permission_key_one_line(tmp_path):
    assert run_cli("id", "--data-dir", str(tmp_path)).returncode == 0
    os.chmod(tmp_path / "identity.key", 0o644)
    line = _one_line_error(run_cli("id", "--data-dir", str(tmp_path)))
    assert "0600" in line


def test_unreadable_key_one_line(tmp_path):
    key = tmp_path / "identity.key"
    key.write_bytes(b"\x00garbage")
    key.chmod(0o600)
    line = _one_line_error(run_cli("id", "--data-dir", str(tmp_path)))
    assert "not a valid" in line


def test_key_path_is_a_directory_one_line(tmp_path):
    (tmp_path / "identity.key").mkdir(mode=0o700)
    _one_line_error(run_cli("id", "--data-dir", str(tmp_path)))


def test_unreachable_peer_one_line(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/12D3KooWLPjuyv6YW6BhdcJpQRuyXwy1xzPuGGtPkYkvaifCC3fs"
    line = _one_line_error(
        run_cli(
            "join", "--data-dir", str(tmp_path), "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
            "--metrics-addr", "off", "--peer", dead, "--bootstrap-timeout", "2",
            timeout=40,
        )
    )
    assert "could not reach any bootstrap peer" in line


def test_status_without_daemon_one_line(tmp_path):
    line = _one_line_error(run_cli("status", "--data-dir", str(tmp_path)))
    assert "no daemon" in line


def test_peers_file_is_read(tmp_path):
    peers = tmp_path / "peers.txt"
    addr = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWLPjuyv6YW6BhdcJpQRuyXwy1xzPuGGtPkYkvaifCC3fs"
    peers.write_text(f"# bootstrap\n{addr}\n\n")
    config = build_node_config(flags={"data_dir": tmp_path, "peers_file": Path(peers)}, config_path=None, environ={})
    assert config.peers == (addr,)
