"""Run settings reach the strategy's config through an explicit table, or are refused."""

from __future__ import annotations

import dataclasses

import pytest

from lattica.cli.main import build_parser
from lattica.config import DEFAULT_INNER_STEPS, STRATEGY_NAMES, TrainSettings
from lattica.errors import ConfigError
from lattica.numerics.screen import ContributionScreen
from lattica.train.settings.strategy_settings import (
    ROUTES,
    STRATEGY_SETTINGS,
    contribution_screen,
    strategy_config,
)
from lattica.train.strategies import STRATEGIES, strategy_class

# a distinct, valid, non-default value for every strategy setting
PROBE = {
    "inner_steps": 24, "outer_lr": 0.31, "outer_momentum": 0.37, "averaging": "gossip", "group_size": 3,
    "group_grace_s": 1.25, "gossip_overlap": True, "outer_state_device": "same",
    "first_moment_rounds": 2, "second_moment_rounds": 5, "staleness_penalty": 0.4, "momentum_clip": 0.6,
    "codec": "int8",
}
SETTING_NAMES = {f.name for f in dataclasses.fields(TrainSettings)}


def test_every_strategy_has_a_route_table():
    assert set(ROUTES) == set(STRATEGIES) == set(STRATEGY_NAMES)  # the setting's Literal names them all
    for routes in ROUTES.values():
        assert set(routes) <= set(STRATEGY_SETTINGS) <= SETTING_NAMES


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_routed_setting_reaches_the_strategy_config(strategy):
    routes = ROUTES[strategy]
    settings = TrainSettings(strategy=strategy, **{k: v for k, v in PROBE.items() if k in routes})
    config = strategy_config(settings)
    for setting, field in routes.items():
        assert getattr(config, field) == PROBE[setting], (strategy, setting, field)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_config_field_named_like_a_setting_is_routed(strategy):
    """The drift guard: a strategy config that grows a field a run setting fills must route it."""
    config_cls = getattr(strategy_class(strategy), "config_class", None)
    if config_cls is None:
        assert not ROUTES[strategy]
        return
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for name in fields & set(STRATEGY_SETTINGS):
        assert ROUTES[strategy].get(name) == name, (strategy, name)
    assert set(ROUTES[strategy].values()) <= fields


def test_outer_momentum_reaches_noloco_as_its_momentum():
    config = strategy_config(TrainSettings(strategy="noloco", outer_momentum=0.2))
    assert config.momentum == 0.2


@pytest.mark.parametrize(
    ("strategy", "setting"),
    [("ddp", "outer_lr"), ("nocomm", "outer_momentum"), ("spes", "outer_lr"), ("spes", "outer_momentum")],
)
def test_a_setting_the_strategy_does_not_use_is_refused(strategy, setting):
    with pytest.raises(ConfigError, match=rf"train\.{setting} is not used by strategy '{strategy}'"):
        strategy_config(TrainSettings(strategy=strategy, **{setting: PROBE[setting]}))


def test_unset_settings_keep_the_strategy_defaults():
    from lattica.train.strategies.noloco import NoLoCoConfig

    assert strategy_config(TrainSettings(strategy="noloco")) == NoLoCoConfig()


def test_a_strategy_config_error_is_a_config_error():
    with pytest.raises(ConfigError, match=r"strategy 'streaming'.*fragments"):
        strategy_config(TrainSettings(strategy="streaming", inner_steps=51))


def test_one_default_h_everywhere():
    assert TrainSettings().inner_steps == DEFAULT_INNER_STEPS
    for strategy in STRATEGIES:
        config_cls = getattr(strategy_class(strategy), "config_class", None)
        h_field = ROUTES[strategy].get("inner_steps")
        if config_cls is not None and h_field is not None:
            assert getattr(config_cls(), h_field) == DEFAULT_INNER_STEPS, strategy
    demo = build_parser().parse_args(["demo"])
    assert demo.inner_steps == DEFAULT_INNER_STEPS


def test_aggregation_settings_map_to_the_screen():
    assert contribution_screen(TrainSettings()) == ContributionScreen(max_norm_ratio=10.0)
    median = contribution_screen(TrainSettings(aggregation="median", max_norm_ratio=None))
    assert median == ContributionScreen(median=True)
    trimmed = contribution_screen(TrainSettings(aggregation="trimmed_mean", trim=2, min_peers=5))
    assert trimmed == ContributionScreen(max_norm_ratio=10.0, trim=2)
