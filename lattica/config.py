"""Frozen, validated configuration of a node.

Only the CLI reads files and environment variables (see ``lattica.cli.settings``); everything
below it receives these dataclasses, already checked. Each ``__post_init__`` raises
``ConfigError`` with a message fit to print as the one line a user sees.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeGuard, get_args

import multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from lattica.errors import ConfigError

DEFAULT_PORT = 4001
DEFAULT_LISTEN = (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}", f"/ip6/::/tcp/{DEFAULT_PORT}")
DEFAULT_METRICS_ADDR = "127.0.0.1:9400"
DEFAULT_INNER_STEPS = 50  # H: inner steps per outer round, for every strategy, the CLI and the demo
# ``lattica demo``'s outer rounds: the default fits in well under 2 minutes with 4 nodes on 2
# CPU cores (``benchmarks/demo_time.py``); ``--long`` trains on to a visibly lower loss
DEMO_ROUNDS = 3
DEMO_LONG_ROUNDS = 20
# the enumerated settings: each a ``Literal`` (what mypy checks) and its values (what a file is
# checked against)
# the outer strategies (``lattica.train.strategies.STRATEGIES`` maps each to its class)
StrategyName = Literal[
    "diloco", "ddp", "nocomm", "noloco", "eager", "streaming", "streaming_eager", "spes", "sparseloco", "demo",
    "local_adam", "desloc", "co2",
]
Aggregation = Literal["mean", "trimmed_mean", "median"]
Averaging = Literal["allreduce", "gossip"]
OuterStateDevice = Literal["cpu", "same"]
TrainingDevice = Literal["auto", "cpu", "cuda"]
InitFrom = Literal["seed", "weights"]
STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)
# the wire codecs of a pseudo-gradient (``numerics/codecs.py``; run setting ``codec``)
WIRE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
AGGREGATIONS: tuple[Aggregation, ...] = get_args(Aggregation)
AVERAGINGS: tuple[Averaging, ...] = get_args(Averaging)
OUTER_STATE_DEVICES: tuple[OuterStateDevice, ...] = get_args(OuterStateDevice)
TRAINING_DEVICES: tuple[TrainingDevice, ...] = get_args(TrainingDevice)
INIT_FROM: tuple[InitFrom, ...] = get_args(InitFrom)
MAX_GROUP_SIZE = 32
# sockaddr_un.sun_path holds 108 bytes on Linux, including the terminating NUL
MAX_UNIX_SOCKET_PATH = 107
_LISTEN_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")
LOG_LEVELS = ("debug", "info", "warning", "error")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def parse_multiaddr(text: str, *, what: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except (MultiaddrError, ValueError, TypeError):
        raise ConfigError(f"malformed multiaddr for {what}: {text!r}") from None


def parse_peer_multiaddr(text: str) -> multiaddr.Multiaddr:
    """A bootstrap address must name the peer: ``/ip4/…/tcp/…/p2p/12D3KooW…``."""
    addr = parse_multiaddr(text, what="--peer")
    try:
        addr.value_for_protocol("p2p")
    except (MultiaddrError, ValueError):
        raise ConfigError(f"peer address {text!r} lacks a /p2p/<peer-id> part") from None
    try:
        addr.value_for_protocol("tcp")
    except (MultiaddrError, ValueError):
        if "p2p-circuit" not in text:
            raise ConfigError(f"peer address {text!r} has no /tcp/<port> part") from None
    return addr


def parse_host_port(text: str, *, what: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what} has a non-numeric port: {text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what} port out of range: {text!r}")
    return host, port


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything ``lattica join`` needs to run a daemon."""

    data_dir: Path
    listen: tuple[str, ...] = DEFAULT_LISTEN
    announce: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    run_id: str = "default"
    metrics_addr: str | None = DEFAULT_METRICS_ADDR
    log_level: str = "warning"
    bootstrap_timeout_s: float = 30.0
    max_backoff_s: float = 30.0
    peer_exchange: bool = True
    nat: bool = True
    upnp: bool = False  # ask the LAN gateway (UPnP IGD) to forward the listen port
    dht: bool = True
    admins: tuple[str, ...] = ()
    secret_file: Path | None = None
    allow_peers: tuple[str, ...] = ()
    train: TrainSettings | None = None

    def __post_init__(self) -> None:
        if not self.listen:
            raise ConfigError("at least one --listen address is required")
        for text in self.listen:
            addr = parse_multiaddr(text, what="--listen")
            protocols = [p.name for p in addr.protocols()]
            if len(protocols) != 2 or protocols[0] not in _LISTEN_HOSTS or protocols[1] != "tcp":
                raise ConfigError(
                    f"--listen must be /ip4|ip6|dns/<host>/tcp/<port> and nothing more, got {text!r}"
                )
        for text in self.announce:
            parse_multiaddr(text, what="--announce")
        for text in self.peers:
            parse_peer_multiaddr(text)
        for admin in self.admins:
            if not re.match(r"^[1-9A-HJ-NP-Za-km-z]{40,60}$", admin):
                raise ConfigError(f"admin must be a peer id, got {admin!r}")
        for peer in self.allow_peers:
            if not re.match(r"^[1-9A-HJ-NP-Za-km-z]{40,60}$", peer):
                raise ConfigError(f"--allow-peer must be a peer id, got {peer!r}")
        if not _RUN_ID.match(self.run_id):
            raise ConfigError(f"run id must be 1-64 of [A-Za-z0-9._-], got {self.run_id!r}")
        if self.metrics_addr is not None:
            parse_host_port(self.metrics_addr, what="--metrics-addr")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        socket_path = str(self.control_socket).encode()
        if len(socket_path) > MAX_UNIX_SOCKET_PATH:
            raise ConfigError(
                f"data dir {self.data_dir} is too long for its control socket ({len(socket_path)} bytes, "
                f"at most {MAX_UNIX_SOCKET_PATH}); use a shorter --data-dir"
            )
        if not 0 < self.bootstrap_timeout_s <= 3600:
            raise ConfigError("bootstrap timeout must be in (0, 3600] seconds")
        if not 0 < self.max_backoff_s <= 3600:
            raise ConfigError("max backoff must be in (0, 3600] seconds")

    @property
    def control_socket(self) -> Path:
        return self.data_dir / "control.sock"


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What a training member of a run does.

    Every field reaches the trainer, the data plane or the chosen strategy
    (``lattica.train.settings.strategy_settings``); a strategy setting left ``None`` keeps that strategy's
    own default, and one set for a strategy that does not use it is refused there. The run-wide
    fields follow the run config an admin published in the replicated state
    (``lattica.train.swarm.run_config``).
    """

    strategy: StrategyName = "diloco"
    model: str = "tiny"  # a GPT or Llama preset, or hf:<local dir> (``train/engine/model_spec.py``)
    init: InitFrom = "seed"  # hf: models: "seed" (fresh weights from the seed) or "weights" (the dir's)
    data: str = "stdlib"
    task: str | None = None
    inner_steps: int = DEFAULT_INNER_STEPS
    rounds: int = 10
    batch_size: int = 16
    seq_len: int = 128
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    outer_lr: float | None = None  # None: the strategy's own default (DiLoCo: 0.7)
    outer_momentum: float | None = None  # None: the strategy's own default (DiLoCo: 0.9, NoLoCo: 0.5)
    round_deadline_s: float = 60.0
    min_peers: int = 1
    seed: int = 0
    device: TrainingDevice = "auto"
    # the node's accelerators: "auto" (every visible CUDA device, else one CPU), a list such as
    # "cuda:0,cuda:2", or "cpu:N" (N CPU ranks); several make one rank per device (train/engine/ranks/)
    devices: str = "auto"
    keep_checkpoints: int = 3
    # how the owner of each part of an all-reduce combines the members' contributions
    aggregation: Aggregation = "mean"
    trim: int = 1  # trimmed_mean: values dropped at each end of every coordinate
    max_norm_ratio: float | None = 10.0  # refuse a contribution above this x the median norm; None: off
    # how the DiLoCo family averages: one all-reduce over the round's members, or gossip inside
    # small groups redrawn every round (no global barrier; replicas then differ slightly)
    averaging: Averaging = "allreduce"
    group_size: int = 2  # gossip averaging and NoLoCo: members per group
    group_grace_s: float = 5.0  # how long a group partner is waited for (handshake, exchange)
    # DiLoCo with gossip: each round's exchange runs during the next inner phase (one round late)
    gossip_overlap: bool = False
    # the inner loop on this node's hardware (each member's own, not run-wide; docs/training.md)
    compile: bool | Literal["auto"] = "auto"  # torch.compile the model; auto: on CUDA, not on the CPU
    micro_batches: int = 1  # gradient accumulation: each step's batch in this many parts
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    # where the DiLoCo family keeps its outer state: "cpu" (pinned memory when training on CUDA)
    # or "same" (the training device)
    outer_state_device: OuterStateDevice = "cpu"
    # DES-LOC / Local Adam: the moments' sync periods in rounds of inner_steps (None: the strategy's)
    first_moment_rounds: int | None = None
    second_moment_rounds: int | None = None
    # CO2: the staleness gap penalty λ and the outer momentum's element-wise bound (0: off)
    staleness_penalty: float | None = None
    momentum_clip: float | None = None
    # re-tune H from measured links between rounds (the admin decides; ``train/settings/retune.py``)
    tune: bool = False
    # the tuner's minimum of applied outer rounds an H must leave the run (``autotune.DEFAULT_MIN_ROUNDS``)
    tune_min_rounds: int = 8
    # the DiLoCo family's wire codec for the pseudo-gradient (None: the strategy's own, fp32)
    codec: str | None = None

    def __post_init__(self) -> None:
        positive = {
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "min_peers": self.min_peers,
            "keep_checkpoints": self.keep_checkpoints,
            "trim": self.trim,
            "micro_batches": self.micro_batches,
        }
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {sorted(STRATEGY_NAMES)}")
        for name, value in positive.items():
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"train.{name} must be an integer >= 0, got {value!r}")
        for name in ("inner_lr", "outer_lr", "round_deadline_s"):
            value = getattr(self, name)
            if name == "outer_lr" and value is None:
                continue
            if not _is_finite(value) or not value > 0:
                raise ConfigError(f"train.{name} must be a finite positive number, got {value!r}")
        if self.outer_momentum is not None and not (_is_finite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"train.outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.max_norm_ratio is not None and not (_is_finite(self.max_norm_ratio) and self.max_norm_ratio >= 1):
            raise ConfigError(
                f"train.max_norm_ratio must be a finite number >= 1 (or off), got {self.max_norm_ratio!r}",
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"train.aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.aggregation == "trimmed_mean" and self.min_peers <= 2 * self.trim:
            raise ConfigError(
                f"train.aggregation trimmed_mean with trim = {self.trim} needs at least {2 * self.trim + 1} "
                f"contributions; set min_peers >= {2 * self.trim + 1} (it is {self.min_peers})"
            )
        try:
            check_averaging(self.averaging, self.group_size, self.gossip_overlap, where="train.",
                            overlap_name="gossip_overlap")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not _is_finite(self.group_grace_s) or not self.group_grace_s > 0:
            raise ConfigError(f"train.group_grace_s must be a finite positive number, got {self.group_grace_s!r}")
        if self.init not in INIT_FROM:
            raise ConfigError(f"train.init must be seed or weights, got {self.init!r}")
        if self.device not in TRAINING_DEVICES:
            raise ConfigError(f"train.device must be auto, cpu or cuda, got {self.device!r}")
        check_devices_syntax(self.devices)
        self._check_inner_loop()
        self._check_research_strategies()

    def _check_research_strategies(self) -> None:
        for name in ("first_moment_rounds", "second_moment_rounds"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tune, bool):
            raise ConfigError(f"train.tune must be true or false, got {self.tune!r}")
        if not _is_int(self.tune_min_rounds) or self.tune_min_rounds < 0:
            raise ConfigError(f"train.tune_min_rounds must be an integer >= 0, got {self.tune_min_rounds!r}")
        if self.codec is not None and self.codec not in WIRE_CODECS:
            raise ConfigError(f"train.codec must be one of {', '.join(WIRE_CODECS)}, got {self.codec!r}")
        for name in ("staleness_penalty", "momentum_clip"):
            value = getattr(self, name)
            if value is not None and (not _is_finite(value) or value < 0):
                raise ConfigError(f"train.{name} must be a finite number >= 0, got {value!r}")

    def _check_inner_loop(self) -> None:
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ConfigError(f"train.compile must be true, false or \"auto\", got {self.compile!r}")
        if self.micro_batches > self.batch_size:
            raise ConfigError(
                f"train.micro_batches ({self.micro_batches}) must be at most train.batch_size ({self.batch_size})"
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(
                f"train.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}"
            )
        if self.outer_state_device not in OUTER_STATE_DEVICES:
            raise ConfigError(
                f"train.outer_state_device must be one of {', '.join(OUTER_STATE_DEVICES)}, "
                f"got {self.outer_state_device!r}"
            )


_DEVICES = re.compile(r"^(auto|cpu(:\d+)?|cuda(:\d+)?(,cuda(:\d+)?)*)$")


def check_devices_syntax(devices: object) -> None:
    """``train.devices`` must read as ``auto``, ``cpu:N`` or a comma-separated list of
    ``cuda:I``; whether those devices exist is checked where they are opened
    (``train/engine/ranks/devices.py``)."""
    if not isinstance(devices, str) or not _DEVICES.match(devices.replace(" ", "")):
        raise ConfigError(
            f"train.devices must be auto, cpu:N or a list such as cuda:0,cuda:1, got {devices!r}"
        )
    if devices.replace(" ", "") in ("cpu:0",):
        raise ConfigError("train.devices cpu:N needs N >= 1 (cpu:0 would train on no device)")


def check_averaging(
    averaging: object, group_size: object, overlap: object = False, *, where: str, overlap_name: str = "overlap",
) -> None:
    """The rules of averaging, for every config that averages (``TrainSettings``, the DiLoCo
    family's strategy configs): a known mode, a group of 2 to ``MAX_GROUP_SIZE`` members, and an
    overlapped exchange only with gossip. ``ValueError`` naming the field behind ``where``
    (``"train."``, ``"DiLoCoConfig."``)."""
    if averaging not in AVERAGINGS:
        raise ValueError(f"{where}averaging must be one of {', '.join(AVERAGINGS)}, got {averaging!r}")
    if not _is_int(group_size) or not 2 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"{where}group_size must be an integer in [2, {MAX_GROUP_SIZE}], got {group_size!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"{where}{overlap_name} must be true or false, got {overlap!r}")  # noqa: TRY004 - one line to the user
    if overlap and averaging != "gossip":
        raise ValueError(f"{where}{overlap_name} needs {where}averaging = \"gossip\" (the overlapped all-reduce is "
                         "strategy \"eager\")")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
