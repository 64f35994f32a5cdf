"""``benchmarks/convergence.py --set METHOD.FIELD=VALUE``: config overrides for sweeps."""

from __future__ import annotations

import pytest

from lattica_lab.benchmark_scripts import load


def test_set_replaces_fields_of_the_named_methods_only() -> None:
    convergence = load("convergence")
    methods = convergence.all_methods()
    changed = convergence.with_overrides(
        methods, ["demo.topk=64", "demo.lr_scale=0.5", "sparseloco.error_decay=0.9", "sparseloco.inner_steps=20"]
    )
    assert (changed["demo"].config.topk, changed["demo"].config.lr_scale) == (64, 0.5)
    assert isinstance(changed["demo"].config.topk, int)
    assert (changed["sparseloco"].config.error_decay, changed["sparseloco"].config.inner_steps) == (0.9, 20)
    assert changed["diloco"] is methods["diloco"]
    assert methods["demo"].config.topk != 64  # the originals are untouched


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("demo.nope=1", "has no field 'nope'"),
        ("demo.topk=x", "invalid literal"),
        ("unknown.topk=1", "expected METHOD.FIELD=VALUE"),
        ("demo.topk", "expected METHOD.FIELD=VALUE"),
        ("demo.topk=0", "topk must be >= 1"),
        ("ddp.lr=1", "without a config"),
    ],
)
def test_a_bad_override_is_one_line_and_exit_2(capsys, item: str, message: str) -> None:
    convergence = load("convergence")
    assert convergence.main(["--strategies", "demo", "--set", item]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set:")
    assert message in err
    assert "\n" not in err


def test_a_llama_model_takes_its_family_defaults_and_the_command_line_still_wins() -> None:
    from lattica.train.settings.family_defaults import FAMILY_DEFAULTS

    convergence = load("convergence")
    tiny = convergence.all_methods()
    llama = convergence.with_model(tiny, "llama-tiny", 1024, 128)
    for name in ("diloco", "diloco_gossip", "sparseloco", "demo"):
        method = llama[name]
        for field, value in FAMILY_DEFAULTS["llama"].get(method.strategy, {}).items():
            assert getattr(method.config, field) == value != getattr(tiny[name].config, field), (name, field)
    assert llama["diloco"].config.outer_lr == 0.5
    assert llama["moe_diloco"] is tiny["moe_diloco"]  # the experts' model is not a Llama
    assert convergence.with_model(tiny, "mini", 256, 128)["diloco"].config == tiny["diloco"].config
    chosen = convergence.with_command_line(llama, 0.7, None, ["demo.topk=64"])
    assert (chosen["diloco"].config.outer_lr, chosen["demo"].config.topk) == (0.7, 64)
