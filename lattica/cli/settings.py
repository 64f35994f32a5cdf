"""Config precedence for ``lattica join``: flags > ``LATTICA_*`` env vars > TOML file > defaults.

This is the only place that reads the environment and config files. The merged values are
validated once, into the frozen dataclasses of ``lattica.config``.
"""

from __future__ import annotations

import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from lattica.config import DEFAULT_PORT, NodeConfig, TrainSettings
from lattica.decoding import build, str_map
from lattica.errors import ConfigError
from lattica.files import read_text

ENV_PREFIX = "LATTICA_"
MAX_CONFIG_BYTES = 1 << 20
MAX_PEERS_FILE_BYTES = 1 << 20

# key -> kind; "list" values come from TOML arrays, repeated flags, or comma-separated env vars;
# "float?" also takes "off"/"none" for None; "bool|auto" is a bool or the word "auto". Derived
# from the config dataclasses, so a field cannot be missing here; ``peers_file`` is the CLI's own
# (its lines are added to ``peers``).
_KINDS: dict[object, str] = {
    int: "int",
    float: "float",
    str: "str",
    bool: "bool",
    Path: "path",
    tuple[str, ...]: "list",
    float | None: "float?",
    int | None: "int?",
    str | None: "str",
    Path | None: "path",
    bool | Literal["auto"]: "bool|auto",
}
_CLI_ONLY_KEYS = {"peers_file": "path"}
# what ``_coerce`` turns a value of each kind into
SettingValue = int | float | str | bool | Path | tuple[str, ...] | None


def _keys_of(cls: type, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    hints = get_type_hints(cls)
    out: dict[str, str] = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        kind = _KINDS.get(hints[f.name]) or _choice_kind(hints[f.name])
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no config-file kind for {hints[f.name]!r}")
        out[f.name] = kind
    return out


def _choice_kind(hint: object) -> str | None:
    """An enumerated setting (a ``Literal`` of strings) is read as a string; its ``__post_init__``
    checks the value."""
    if get_origin(hint) is Literal and all(isinstance(choice, str) for choice in get_args(hint)):
        return "str"
    return None


NODE_KEYS: dict[str, str] = {**_keys_of(NodeConfig, skip=("train",)), **_CLI_ONLY_KEYS}
TRAIN_KEYS: dict[str, str] = _keys_of(TrainSettings)
# optional numbers that default to a number: there "off" (None) turns them off; where the default
# is None ("outer_lr": the strategy's own), "off"/"none" only means that default
_OFF_WHEN_NONE = frozenset(
    f.name for cls, keys in ((NodeConfig, NODE_KEYS), (TrainSettings, TRAIN_KEYS)) for f in fields(cls)
    if keys.get(f.name) == "float?" and f.default is not None
)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lattica"


def read_toml(path: Path) -> dict[str, object]:
    text = read_text(path, what="config file", max_bytes=MAX_CONFIG_BYTES)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _convert(kind: str, value: object) -> SettingValue:
    """``value`` as a setting of ``kind``; ``TypeError``/``ValueError`` when it is not one."""
    if kind == "list":
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise TypeError
    if kind == "path":
        if not isinstance(value, str | Path) or not str(value):
            raise TypeError
        return Path(value).expanduser()
    if kind == "int?" and isinstance(value, str) and value.strip().lower() == "none":
        return None
    if kind in ("int", "int?"):
        # TOML 1.5 or an env "1.5" is refused, not truncated
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
        raise TypeError
    if kind in ("float", "float?"):
        if kind == "float?" and isinstance(value, str) and value.strip().lower() in ("off", "none"):
            return None
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        return number
    if kind == "bool|auto" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if kind in ("bool", "bool|auto"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise TypeError
    if not isinstance(value, str):
        raise TypeError
    return value


def _coerce(key: str, kind: str, value: object, source: str) -> SettingValue:
    try:
        return _convert(kind, value)
    except (TypeError, ValueError):
        name = key.rpartition(".")[2].removeprefix("train_")
        optional = (
            "a finite number or 'off'" if name in _OFF_WHEN_NONE else "a finite number, or 'none' for the default"
        )
        expected = {"int": "an integer", "int?": "an integer, or 'none' for the default", "float": "a finite number",
                    "float?": optional,
                    "bool|auto": "true, false or 'auto'"}
        raise ConfigError(
            f"{source}: {key} has an invalid value {value!r} (expected {expected.get(kind, kind)})"
        ) from None


def _layer(
    data: Mapping[str, object], keys: dict[str, str], source: str, prefix: str = ""
) -> dict[str, SettingValue]:
    out: dict[str, SettingValue] = {}
    for key, value in data.items():
        if key not in keys:
            raise ConfigError(f"{source}: unknown key {prefix + key!r}")
        out[key] = _coerce(prefix + key, keys[key], value, source)
    return out


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, SettingValue], dict[str, SettingValue]]:
    node: dict[str, SettingValue] = {}
    train: dict[str, SettingValue] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "LATTICA_CONFIG":
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key.startswith("train_") and key[6:] in TRAIN_KEYS:
            train[key[6:]] = _coerce(key, TRAIN_KEYS[key[6:]], value, f"environment {name}")
        elif key in NODE_KEYS:
            node[key] = _coerce(key, NODE_KEYS[key], value, f"environment {name}")
        else:
            raise ConfigError(f"environment: unknown variable {name}")
    return node, train


def file_layer(path: Path | None) -> tuple[dict[str, SettingValue], dict[str, SettingValue] | None]:
    if path is None:
        return {}, None
    data = read_toml(path)
    raw_train = data.pop("train", None)
    train_section = str_map(raw_train)  # TOML table keys are strings
    if raw_train is not None and train_section is None:
        raise ConfigError(f"{path}: [train] must be a table")
    node = _layer(data, NODE_KEYS, str(path))
    train = _layer(train_section, TRAIN_KEYS, str(path), "train.") if train_section is not None else None
    return node, train


def read_peers_file(path: Path) -> tuple[str, ...]:
    text = read_text(path, what="peers file", max_bytes=MAX_PEERS_FILE_BYTES)
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return tuple(line for line in lines if line)


def _ipv6_available() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def default_listen() -> tuple[str, ...]:
    addrs = [f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"]
    if _ipv6_available():
        addrs.append(f"/ip6/::/tcp/{DEFAULT_PORT}")
    return tuple(addrs)


def build_node_config(
    *,
    flags: Mapping[str, object],
    train_flags: Mapping[str, object] | None = None,
    config_path: Path | None,
    environ: Mapping[str, str],
    with_training: bool = False,
) -> NodeConfig:
    """Merge the layers (flags win, then env, then file) and validate them once."""
    if config_path is None and environ.get("LATTICA_CONFIG"):
        config_path = Path(environ["LATTICA_CONFIG"])
    file_node, file_train = file_layer(config_path)
    env_node, env_train = env_layer(environ)
    merged: dict[str, object] = {**file_node, **env_node, **{k: v for k, v in flags.items() if v is not None}}
    peers = _str_tuple(merged.pop("peers", ()), "peers")
    peers_file = merged.pop("peers_file", None)
    if peers_file is not None:
        if not isinstance(peers_file, str | Path):
            raise ConfigError(f"peers_file must be a path, not {peers_file!r}")
        peers = peers + read_peers_file(Path(peers_file))
    merged["peers"] = tuple(dict.fromkeys(peers))
    merged.setdefault("data_dir", default_data_dir())
    if "listen" not in merged:
        merged["listen"] = default_listen()
    if merged.get("metrics_addr") in ("", "off", "none"):
        merged["metrics_addr"] = None
    train_values: dict[str, object] = {
        **(file_train or {}), **env_train, **{k: v for k, v in (train_flags or {}).items() if v is not None}
    }
    if with_training or file_train is not None or train_values:
        merged["train"] = build(TrainSettings, train_values)
    return build(NodeConfig, merged)


def _str_tuple(value: object, key: str) -> tuple[str, ...]:
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{key} must be a list of strings, not {value!r}")

