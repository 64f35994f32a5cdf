"""Every setting of the config dataclasses can be set from the TOML file and from the environment.

The accepted keys and variables are derived from ``NodeConfig`` and ``TrainSettings``; these
tests walk the dataclass fields themselves, give each a value other than its default, and check
that the value arrives in the built config, through either source.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lattica.cli.settings import NODE_KEYS, TRAIN_KEYS, build_node_config
from lattica.config import NodeConfig, TrainSettings

PEER = "12D3KooWLPjuyv6YW6BhdcJpQRuyXwy1xzPuGGtPkYkvaifCC3fs"

# Fields whose valid values cannot be derived from their kind and default (addresses, peer ids,
# names from a fixed set); every other field gets a value derived from its default below.
_SAMPLES: dict[str, Any] = {
    "listen": ("/ip4/127.0.0.1/tcp/4999",),
    "announce": ("/ip4/192.0.2.7/tcp/4001",),
    "peers": (f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",),
    "admins": (PEER,),
    "allow_peers": (PEER,),
    "run_id": "run-7",
    "metrics_addr": "127.0.0.1:9999",
    "log_level": "info",
    "strategy": "noloco",
    "data": "shakespeare",
    "task": "mypkg.tasks:build",
    "device": "cpu",
    "devices": "cpu:2",
    "aggregation": "median",
    "averaging": "gossip",
    "compile": True,
    "outer_state_device": "same",
    "codec": "int8",
}


def _sample(field: dataclasses.Field, kind: str, tmp_path: Path) -> Any:
    if field.name in _SAMPLES:
        return _SAMPLES[field.name]
    default = field.default
    if kind == "bool":
        return not default
    if kind == "int":
        return default + 1
    if kind == "int?":
        return 2 if default is None else default + 1
    if kind in ("float", "float?"):
        return 0.5 if default is None else float(default) * 2
    if kind == "path":
        return tmp_path / field.name
    return default  # a plain string without a known alternative: accepted, unchanged


def _samples(cls: type, keys: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    return {f.name: _sample(f, keys[f.name], tmp_path) for f in dataclasses.fields(cls) if f.name in keys}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    return json.dumps(str(value))


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _node_and_train(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    node = _samples(NodeConfig, NODE_KEYS, tmp_path)
    train = _samples(TrainSettings, TRAIN_KEYS, tmp_path)
    assert set(node) == {f.name for f in dataclasses.fields(NodeConfig)} - {"train"}
    assert set(train) == {f.name for f in dataclasses.fields(TrainSettings)}
    return node, train


def _check(config: NodeConfig, node: dict[str, Any], train: dict[str, Any]) -> None:
    assert config.train is not None
    got = {name: getattr(config, name) for name in node} | {f"train.{n}": getattr(config.train, n) for n in train}
    want = node | {f"train.{n}": v for n, v in train.items()}
    assert got == want
    changed = [n for n, v in want.items() if v != _default_of(n)]
    assert len(changed) >= len(want) - 2  # all but plain strings like model, which keep their default


def _default_of(name: str) -> Any:
    cls, field = (TrainSettings, name[6:]) if name.startswith("train.") else (NodeConfig, name)
    return {f.name: f.default for f in dataclasses.fields(cls)}[field]


def test_every_field_can_be_set_from_the_config_file(tmp_path: Path) -> None:
    node, train = _node_and_train(tmp_path)
    text = "".join(f"{k} = {_toml_value(v)}\n" for k, v in node.items())
    text += "[train]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in train.items())
    path = tmp_path / "node.toml"
    path.write_text(text)
    _check(build_node_config(flags={}, config_path=path, environ={}), node, train)


def test_every_field_can_be_set_from_the_environment(tmp_path: Path) -> None:
    node, train = _node_and_train(tmp_path)
    environ = {f"LATTICA_{k.upper()}": _env_value(v) for k, v in node.items()}
    environ |= {f"LATTICA_TRAIN_{k.upper()}": _env_value(v) for k, v in train.items()}
    _check(build_node_config(flags={}, config_path=None, environ=environ), node, train)


@pytest.mark.parametrize("source", ["file", "env"])
def test_a_name_that_is_no_field_is_refused(tmp_path: Path, source: str) -> None:
    from lattica.errors import ConfigError

    path = tmp_path / "node.toml"
    path.write_text("[train]\ninner_step = 5\n")  # a near miss of inner_steps
    kwargs: dict[str, Any] = (
        {"config_path": path, "environ": {}} if source == "file"
        else {"config_path": None, "environ": {"LATTICA_TRAIN_INNER_STEP": "5"}}
    )
    with pytest.raises(ConfigError, match=r"unknown (key 'train\.inner_step'|variable LATTICA_TRAIN_INNER_STEP)"):
        build_node_config(flags={"data_dir": tmp_path}, **kwargs)
