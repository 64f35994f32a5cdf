"""The scripts in ``benchmarks/`` as modules, for tests of their pure parts (summaries, flags).

The scripts are not a package: each is loaded from its file once per test process, with the
``benchmarks/`` folder on ``sys.path`` so that its helper ``_checkout`` imports as when it runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``_bench_<name>`` (loaded on first use)."""
    module_name = f"_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
