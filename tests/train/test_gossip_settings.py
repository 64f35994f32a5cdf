"""``averaging``, ``group_size``, ``group_grace_s`` and ``gossip_overlap``: from TOML, env and flags to the
strategy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lattica.cli.main import build_parser
from lattica.cli.settings import build_node_config
from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.swarm.run_config import run_config_of


def test_gossip_reaches_diloco_from_toml_env_and_flags(tmp_path) -> None:
    toml = tmp_path / "lattica.toml"
    toml.write_text('[train]\nstrategy = "diloco"\naveraging = "gossip"\ngroup_size = 3\n')
    config = build_node_config(flags={"data_dir": tmp_path}, config_path=toml, environ={})
    assert config.train is not None
    cfg = strategy_config(config.train)
    assert (cfg.averaging, cfg.group_size, cfg.exchange_timeout_s) == ("gossip", 3, 5.0)

    env = {"LATTICA_TRAIN_AVERAGING": "gossip", "LATTICA_TRAIN_GROUP_GRACE_S": "2.5"}
    config = build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ=env, with_training=True)
    assert config.train is not None
    cfg = strategy_config(config.train)
    assert (cfg.averaging, cfg.group_size, cfg.exchange_timeout_s) == ("gossip", 2, 2.5)

    config = build_node_config(
        flags={"data_dir": tmp_path}, train_flags={"averaging": "allreduce", "group_size": 4}, config_path=toml,
        environ=env,
    )
    assert config.train is not None
    cfg = strategy_config(config.train)
    assert (cfg.averaging, cfg.group_size) == ("allreduce", 4)  # flags win over env and file


def test_allreduce_is_the_default_and_the_settings_are_run_wide() -> None:
    assert strategy_config(TrainSettings()).averaging == "allreduce"
    published = run_config_of(TrainSettings(averaging="gossip", group_size=3))
    assert published["averaging"] == "gossip"
    assert published["group_size"] == 3


def test_noloco_takes_its_group_size_and_grace() -> None:
    cfg = strategy_config(TrainSettings(strategy="noloco", group_size=3, group_grace_s=1.5))
    assert (cfg.group_size, cfg.exchange_timeout_s) == (3, 1.5)


def test_gossip_for_a_strategy_without_it_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="averaging is not used by strategy 'streaming'"):
        strategy_config(TrainSettings(strategy="streaming", averaging="gossip"))
    with pytest.raises(ConfigError, match="group_size is not used by strategy 'eager'"):
        strategy_config(TrainSettings(strategy="eager", group_size=3))


def test_gossip_overlap_reaches_diloco_from_toml_env_and_flags(tmp_path) -> None:
    toml = tmp_path / "lattica.toml"
    toml.write_text('[train]\naveraging = "gossip"\ngossip_overlap = true\n')
    config = build_node_config(flags={"data_dir": tmp_path}, config_path=toml, environ={})
    assert config.train is not None
    assert strategy_config(config.train).overlap is True
    env = {"LATTICA_TRAIN_AVERAGING": "gossip", "LATTICA_TRAIN_GOSSIP_OVERLAP": "true"}
    config = build_node_config(flags={"data_dir": tmp_path}, config_path=None, environ=env, with_training=True)
    assert config.train is not None
    assert strategy_config(config.train).overlap is True
    args = build_parser().parse_args(["join", "--train", "--averaging", "gossip", "--gossip-overlap"])
    assert args.gossip_overlap is True
    assert build_parser().parse_args(["join"]).gossip_overlap is None  # unset: the file's or the default
    assert strategy_config(TrainSettings(averaging="gossip")).overlap is False
    assert run_config_of(TrainSettings(averaging="gossip", gossip_overlap=True))["gossip_overlap"] is True


def test_gossip_overlap_needs_gossip_and_diloco() -> None:
    with pytest.raises(ConfigError, match=r'gossip_overlap needs train\.averaging = "gossip"'):
        TrainSettings(gossip_overlap=True)
    with pytest.raises(ConfigError, match="not used by strategy 'sparseloco'"):
        strategy_config(TrainSettings(strategy="sparseloco", averaging="gossip", gossip_overlap=True))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("averaging", "ring", "train.averaging must be one of"), ("group_size", 1, "train.group_size"),
     ("group_size", 2.0, "train.group_size"), ("group_grace_s", 0.0, "train.group_grace_s"),
     ("gossip_overlap", "yes", "train.gossip_overlap must be true or false")],
)
def test_bad_values_are_one_line_errors(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainSettings(**{field: value})


def test_cli_refuses_a_bad_averaging_in_one_line(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lattica.cli.main", "join", "--train", "--data-dir", str(tmp_path / "d"),
         "--strategy", "streaming", "--averaging", "gossip"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "averaging is not used by strategy 'streaming'" in result.stderr
    assert "Traceback" not in result.stderr
