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
from lattica_lab.daemons import free_port, run_cli


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
    config.write_text(
        'run_id = "from-file"\nlog_level = "info"\nmetrics_addr = "127.0.0.1:9500"\n[train]\nrounds = 3\n',
    )
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
            run_cli(
                "join", "--data-dir", str(tmp_path), "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--metrics-addr", "off",
            )
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


# -- every bad input a newcomer meets is one line ----------------------------------------------


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("[train]\nrounds = 1.5\n", {}, "expected an integer"),
        ("[train]\ninner_steps = 2.0\n", {}, "expected an integer"),
        ("", {"LATTICA_TRAIN_ROUNDS": "1.5"}, "expected an integer"),
        ("[train]\ninner_lr = inf\n", {}, "finite"),
        ("[train]\nround_deadline_s = nan\n", {}, "finite"),
        ("[train]\nouter_lr = inf\n", {}, "finite"),
        ("", {"LATTICA_TRAIN_INNER_LR": "inf"}, "finite"),
        ("", {"LATTICA_TRAIN_ROUND_DEADLINE_S": "nan"}, "finite"),
        ("bootstrap_timeout_s = inf\n", {}, "finite"),
        ('listen = ["/ip4/127.0.0.1/tcp/4001/ws"]\n', {}, "nothing more"),
        ('listen = ["/ip4/127.0.0.1/udp/4001/tcp/4002"]\n', {}, "nothing more"),
        ('listen = ["/ip4/127.0.0.1/udp/4001/quic-v1"]\n', {}, "nothing more"),
        ("[train]\nextra = 1\n", {}, "unknown key"),
        ('[train]\naggregation = "vote"\n', {}, "aggregation"),
        ('[train]\naggregation = "trimmed_mean"\nmin_peers = 2\n', {}, "at least 3 contributions"),
        ("[train]\nmax_norm_ratio = 0.5\n", {}, "max_norm_ratio"),
    ],
)
def test_values_are_never_truncated_or_infinite(tmp_path, toml, env, message):
    config = tmp_path / "node.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        build_node_config(flags={"data_dir": tmp_path}, config_path=config, environ=env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LATTICA_TRAIN_OUTER_LR": "inf"}, "(expected a finite number, or 'none' for the default)"),
        ({"LATTICA_TRAIN_OUTER_MOMENTUM": "inf"}, "(expected a finite number, or 'none' for the default)"),
        ({"LATTICA_TRAIN_MAX_NORM_RATIO": "inf"}, "(expected a finite number or 'off')"),
    ],
)
def test_off_is_offered_only_where_it_turns_something_off(tmp_path, env, expected):
    with pytest.raises(ConfigError) as info:
        build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ=env)
    assert str(info.value).endswith(expected)


def test_none_is_the_strategy_default_and_off_turns_the_norm_screen_off(tmp_path):
    env = {"LATTICA_TRAIN_OUTER_LR": "none", "LATTICA_TRAIN_MAX_NORM_RATIO": "off"}
    train = build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ=env).train
    assert train.outer_lr is None
    assert train.max_norm_ratio is None


def test_dns_listen_addresses_are_accepted(tmp_path):
    config = build_node_config(
        flags={"data_dir": tmp_path, "listen": ("/dns4/localhost/tcp/4001",)}, config_path=None, environ={}
    )
    assert config.listen == ("/dns4/localhost/tcp/4001",)


def test_data_dir_that_is_a_file_one_line(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    line = _one_line_error(run_cli("join", "--data-dir", str(target), "--metrics-addr", "off"))
    assert "not a directory" in line
    line = _one_line_error(run_cli("id", "--data-dir", str(target)))
    assert "not a directory" in line


def test_data_dir_that_cannot_be_created_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    line = _one_line_error(run_cli("join", "--data-dir", str(tmp_path / "file" / "sub"), "--metrics-addr", "off"))
    assert "cannot create data dir" in line


def test_read_only_data_dir_one_line():
    # sysfs refuses new files even to root (a chmod would not stop root)
    line = _one_line_error(run_cli("join", "--data-dir", "/sys", "--metrics-addr", "off"))
    assert "not writable" in line


def test_data_dir_too_long_for_the_control_socket_one_line(tmp_path):
    deep = tmp_path / ("d" * 110)
    line = _one_line_error(run_cli("join", "--data-dir", str(deep), "--metrics-addr", "off"))
    assert "too long for its control socket" in line
    assert "None" not in line


@pytest.mark.parametrize(
    ("addr", "message"),
    [("no-such-host.invalid:9400", "cannot be resolved"), ("192.0.2.1:9400", "not an address of this machine")],
)
def test_metrics_host_unresolvable_or_not_local_one_line(tmp_path, addr, message):
    listen = f"/ip4/127.0.0.1/tcp/{free_port()}"
    line = _one_line_error(run_cli("join", "--data-dir", str(tmp_path), "--listen", listen, "--metrics-addr", addr))
    assert message in line


def test_key_file_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "identity.key").mkdir(mode=0o755)
    line = _one_line_error(run_cli("id", "--data-dir", str(tmp_path)))
    assert "is a directory" in line
    assert "mode" not in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--data", "/no/such/corpus.txt"), "does not exist"),
        (("--task", "no_such_module_xyz:make"), "cannot import task module"),
        (("--task", "json:no_such_function"), "has no attribute"),
        (("--strategy", "streaming", "--inner-steps", "51"), "fragments"),
    ],
)
def test_bad_training_input_fails_the_start(tmp_path, args, message):
    """Refused before the daemon serves: no control socket, one line, non-zero exit."""
    line = _one_line_error(
        run_cli(
            "join", "--data-dir", str(tmp_path), "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
            "--metrics-addr", "off", "--train", *args, timeout=60,
        )
    )
    assert message in line
    assert not (tmp_path / "control.sock").exists()


# -- access control from the config file and the environment -------------------------------------


PEER = "12D3KooWLPjuyv6YW6BhdcJpQRuyXwy1xzPuGGtPkYkvaifCC3fs"


def test_every_config_field_is_a_config_file_key(tmp_path):
    """The accepted keys come from the dataclasses: each field can be set from TOML."""
    from lattica.cli.settings import NODE_KEYS, TRAIN_KEYS
    from lattica.config import TrainSettings

    assert set(NODE_KEYS) == {f.name for f in dataclasses.fields(NodeConfig)} - {"train"} | {"peers_file"}
    assert set(TRAIN_KEYS) == {f.name for f in dataclasses.fields(TrainSettings)}


def test_access_control_from_toml_and_env(tmp_path):
    secret = tmp_path / "run.secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    config = tmp_path / "node.toml"
    config.write_text(f'secret_file = "{secret}"\nallow_peers = ["{PEER}"]\n')
    merged = build_node_config(flags={"data_dir": tmp_path}, config_path=config, environ={})
    assert merged.secret_file == secret
    assert merged.allow_peers == (PEER,)
    env = {"LATTICA_SECRET_FILE": str(secret), "LATTICA_ALLOW_PEERS": f"{PEER},{PEER}"}
    merged = build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ=env)
    assert merged.secret_file == secret
    assert merged.allow_peers == (PEER, PEER)
    with pytest.raises(ConfigError, match="peer id"):
        build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ={"LATTICA_ALLOW_PEERS": "nope"})


def test_daemon_reads_the_secret_named_in_its_config_file(tmp_path):
    from lattica_lab.daemons import DaemonProcess

    secret = tmp_path / "run.secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    config = tmp_path / "node.toml"
    config.write_text(f'secret_file = "{secret}"\nallow_peers = ["{PEER}"]\n')
    daemon = DaemonProcess(tmp_path / "d", extra_args=("--config", str(config))).start()
    try:
        status = daemon.wait_ready(timeout=60)
        assert status["access"]["mode"] == "allowlist+secret"
    finally:
        daemon.stop()
    secret.chmod(0o644)  # the daemon reads it itself, with the same checks as --secret-file
    line = _one_line_error(
        run_cli("join", "--data-dir", str(tmp_path / "d"), "--config", str(config), "--metrics-addr", "off")
    )
    assert "0600" in line


def test_a_setting_the_strategy_does_not_use_fails_the_start(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text('[train]\nstrategy = "ddp"\nouter_momentum = 0.5\n')
    line = _one_line_error(
        run_cli(
            "join", "--data-dir", str(tmp_path), "--config", str(config), "--metrics-addr", "off",
            "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}", timeout=60,
        )
    )
    assert "train.outer_momentum is not used by strategy 'ddp'" in line
