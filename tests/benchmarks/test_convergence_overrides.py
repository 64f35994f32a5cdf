"""``benchmarks/convergence.py --set METHOD.FIELD=VALUE``: config overrides for sweeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _convergence() -> ModuleType:
    name = "_bench_convergence_overrides"
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "convergence.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_set_replaces_fields_of_the_named_methods_only() -> None:
    convergence = _convergence()
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
    convergence = _convergence()
    assert convergence.main(["--strategies", "demo", "--set", item]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set:")
    assert message in err
    assert "\n" not in err
