"""The wheel holds only the product; the product imports no test or lab code.

The lab harness (``lattica_lab/``) and the tests live beside ``lattica/`` in the checkout and
are never installed. The wheel is built from a copy of the checkout the way a user builds it
(``pip wheel .``, offline, with the setuptools of this environment).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB_MARKERS = ("testing", "_lab_", "_peer_", "_bench", "_demo_node", "lattica_lab", "tests/", "benchmarks/")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("lattica", "lattica_lab", "tests", "benchmarks"):  # all of them, as in a checkout
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("lattica-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_the_wheel_holds_only_the_product(wheel_names: list[str]) -> None:
    modules = [n for n in wheel_names if not n.startswith("lattica-")]  # minus .dist-info
    assert "lattica/cli/main.py" in modules
    assert "lattica/net/tensors/transfer.py" in modules
    assert all(n.startswith("lattica/") for n in modules), [n for n in modules if not n.startswith("lattica/")]
    lab = [n for n in modules if any(m in n for m in LAB_MARKERS)]
    assert lab == [], lab


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, and every string that names a module to run (``-m x``)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names.append(node.value)  # a dotted module name, e.g. after "-m"
    return names


def _product_files() -> list[Path]:
    files = sorted((ROOT / "lattica").rglob("*.py"))
    assert len(files) > 50
    return files


def test_nothing_in_the_product_imports_the_lab_or_the_tests() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _product_files()
        for name in _imports(path)
        if name.split(".")[0] == "lattica_lab" or name.startswith(("tests.", "benchmarks.", "lattica.testing"))
    ]
    assert offenders == []
