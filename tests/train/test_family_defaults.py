"""A strategy's unset fields take its model family's defaults; what the user sets wins."""

from __future__ import annotations

import dataclasses

import pytest

from lattica.cli.main import STRATEGY_DEFAULTS_HELP
from lattica.config import TrainSettings
from lattica.train.engine.model_spec import model_family
from lattica.train.settings.family_defaults import FAMILY_DEFAULTS, family_defaults, family_defaults_help
from lattica.train.settings.strategy_settings import ROUTES, strategy_config
from lattica.train.strategies import strategy_class

LLAMA = FAMILY_DEFAULTS["llama"]


def test_the_model_setting_names_its_family():
    assert [model_family(m) for m in ("tiny", "gpt-125m", "llama-tiny", "llama-1b", "hf:/some/dir")] == [
        "gpt", "gpt", "llama", "llama", "hf",
    ]
    assert model_family("no-such-preset") is None


def test_a_llama_preset_trains_diloco_at_its_own_outer_lr():
    assert strategy_config(TrainSettings(strategy="diloco", model="llama-tiny")).outer_lr == 0.5
    assert strategy_config(TrainSettings(strategy="diloco", model="llama-1b")).outer_lr == 0.5


def test_the_byte_level_gpt_keeps_the_class_defaults():
    for strategy in ("diloco", "sparseloco", "demo"):
        default = strategy_class(strategy).config_class()
        for model in ("tiny", "small"):
            assert strategy_config(TrainSettings(strategy=strategy, model=model)) == default, (strategy, model)


def test_a_user_task_keeps_the_class_defaults_whatever_the_model_setting():
    config = strategy_config(TrainSettings(strategy="diloco", model="llama-tiny", task="pkg.mod:build"))
    assert config == strategy_class("diloco").config_class()


@pytest.mark.parametrize("strategy", sorted(LLAMA))
def test_every_llama_default_applies_and_differs_from_the_class_default(strategy):
    default = strategy_class(strategy).config_class()
    config = strategy_config(TrainSettings(strategy=strategy, model="llama-tiny"))
    for name, value in LLAMA[strategy].items():
        assert getattr(config, name) == value != getattr(default, name), (strategy, name)
    untouched = {f.name for f in dataclasses.fields(default)} - set(LLAMA[strategy])
    assert all(getattr(config, n) == getattr(default, n) for n in untouched)


@pytest.mark.parametrize("strategy", sorted(LLAMA))
def test_an_explicit_setting_wins_over_the_family_default(strategy):
    routed = {ROUTES[strategy][s]: s for s in ROUTES[strategy]}
    explicit = {routed[name]: 0.9 for name in LLAMA[strategy] if routed.get(name) == "outer_lr"}
    if not explicit:
        pytest.skip(f"no llama default of {strategy} is a run setting")
    config = strategy_config(TrainSettings(strategy=strategy, model="llama-tiny", **explicit))  # type: ignore[arg-type]
    assert config.outer_lr == 0.9


def test_an_explicit_value_equal_to_the_class_default_still_wins():
    config = strategy_config(TrainSettings(strategy="diloco", model="llama-tiny", outer_lr=0.7))
    assert config.outer_lr == 0.7


def test_families_without_measured_defaults_have_none():
    assert family_defaults("diloco", "gpt") == family_defaults("diloco", "hf") == family_defaults("diloco", None) == {}
    assert family_defaults("nocomm", "llama") == {}


def test_join_help_lists_the_family_defaults():
    assert family_defaults_help() == STRATEGY_DEFAULTS_HELP
