"""From the run settings (``TrainSettings``) to the chosen strategy's own config.

Each strategy lists, in ``ROUTES``, which run setting fills which field of its config — an
explicit table, not matching by name: NoLoCo's outer momentum is its ``momentum``, SPES's H is
its ``sync_every``. A strategy setting that is set (not ``None``) for a strategy without a route
for it is refused with a line naming the setting and the strategy, so nothing a user writes is
silently dropped. The other run settings (model, data, rounds, learning-rate schedule, device,
aggregation, ...) belong to the trainer and the data plane, for every strategy;
``contribution_screen`` maps the aggregation settings onto the data plane's screen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from lattica.config import StrategyName, TrainSettings
from lattica.errors import ConfigError
from lattica.numerics.screen import ContributionScreen
from lattica.train.settings.family_defaults import family_defaults, run_model_family

# run setting -> config field, per strategy
ROUTES: dict[StrategyName, Mapping[str, str]] = {
    "diloco": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
        "averaging": "averaging", "group_size": "group_size", "group_grace_s": "exchange_timeout_s",
        "gossip_overlap": "overlap", "outer_state_device": "outer_state_device",
    },
    "eager": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
        "outer_state_device": "outer_state_device",
    },
    "streaming": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
    },
    "streaming_eager": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
    },
    "noloco": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "momentum",
        "group_size": "group_size", "group_grace_s": "exchange_timeout_s",
    },
    "spes": {
        "codec": "codec",
        "inner_steps": "sync_every", "averaging": "averaging", "group_size": "group_size",
        "group_grace_s": "exchange_timeout_s",
    },
    # no outer momentum: the error-feedback decay takes its place (its own default, 0.95)
    "sparseloco": {
        "inner_steps": "inner_steps", "outer_lr": "outer_lr",
        "averaging": "averaging", "group_size": "group_size", "group_grace_s": "exchange_timeout_s",
    },
    "demo": {"inner_steps": "inner_steps"},  # syncs every step; H: steps per reported round
    "local_adam": {
        "codec": "codec",
        "inner_steps": "inner_steps", "averaging": "averaging", "group_size": "group_size",
        "group_grace_s": "exchange_timeout_s", "first_moment_rounds": "first_moment_rounds",
        "second_moment_rounds": "second_moment_rounds",
    },
    "desloc": {
        "codec": "codec",
        "inner_steps": "inner_steps", "averaging": "averaging", "group_size": "group_size",
        "group_grace_s": "exchange_timeout_s", "first_moment_rounds": "first_moment_rounds",
        "second_moment_rounds": "second_moment_rounds",
    },
    # momentum_clip 0 turns the clip off (``_co2_derived``)
    "co2": {
        "codec": "codec",
        "inner_steps": "inner_steps", "outer_lr": "outer_lr", "outer_momentum": "outer_momentum",
        "staleness_penalty": "staleness_penalty", "momentum_clip": "momentum_clip",
        "outer_state_device": "outer_state_device",
    },
    "ddp": {"codec": "codec"},  # averages gradients every step: H only sets the trainer's round length
    "nocomm": {},
}
# settings that only a strategy uses; ``inner_steps`` is also the trainer's round length
STRATEGY_SETTINGS = (
    "inner_steps", "outer_lr", "outer_momentum", "averaging", "group_size", "group_grace_s", "gossip_overlap",
    "outer_state_device", "first_moment_rounds", "second_moment_rounds", "staleness_penalty", "momentum_clip",
    "codec",
)
_TRAINER_TOO = ("inner_steps",)
_SPES_WARMUP_STEPS = 500  # SPES merges similar experts about every 500 steps, a multiple of S
# a setting left at its default (``None``: the strategy's own) is not "set"
_DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(TrainSettings)}


def check_strategy_settings(settings: TrainSettings) -> None:
    """Refuse a strategy setting that the chosen strategy would not use."""
    routes = ROUTES[settings.strategy]
    for name in STRATEGY_SETTINGS:
        if name in routes or name in _TRAINER_TOO or getattr(settings, name) == _DEFAULTS[name]:
            continue
        users = sorted(s for s, r in ROUTES.items() if name in r)
        raise ConfigError(
            f"train.{name} is not used by strategy {settings.strategy!r} (only by {', '.join(users)}); remove it"
        )


def strategy_config(settings: TrainSettings, *, members: tuple[str, ...] = ()) -> object | None:
    """The config of ``settings.strategy`` (None for a strategy without one); unset settings
    keep the strategy's own defaults, or its model family's where they differ
    (``family_defaults``). ``members``: SPES's initial expert owners."""
    check_strategy_settings(settings)
    from lattica.train.strategies import strategy_class

    config_cls = strategy_class(settings.strategy).config_class
    if config_cls is None:
        return None
    # the model family's defaults first (``family_defaults``), then what the settings set
    values = family_defaults(settings.strategy, run_model_family(settings.model, settings.task))
    for setting, field_name in ROUTES[settings.strategy].items():
        value = getattr(settings, setting)
        if value is not None:
            values[field_name] = value
    derive = _DERIVED.get(settings.strategy)
    if derive is not None:
        values.update(derive(settings, members))
    try:
        config: object = config_cls(**values)
    except ValueError as exc:
        raise ConfigError(f"strategy {settings.strategy!r}: {exc}") from None
    return config


def contribution_screen(settings: TrainSettings) -> ContributionScreen:
    """How the owner of each part of an all-reduce combines contributions (``screen.py``)."""
    return ContributionScreen(
        max_norm_ratio=settings.max_norm_ratio,
        trim=settings.trim if settings.aggregation == "trimmed_mean" else 0,
        median=settings.aggregation == "median",
    )


def _spes_derived(settings: TrainSettings, members: tuple[str, ...]) -> dict[str, object]:
    h = settings.inner_steps
    return {"merge_every": h * max(1, round(_SPES_WARMUP_STEPS / h)), "members": members}


def _co2_derived(settings: TrainSettings, members: tuple[str, ...]) -> dict[str, object]:
    clip = settings.momentum_clip
    return {} if clip is None else {"momentum_clip": clip or None}


_DERIVED: dict[str, Callable[[TrainSettings, tuple[str, ...]], dict[str, object]]] = {
    "spes": _spes_derived, "co2": _co2_derived,
}

