"""Who may import what inside the product (see docs/architecture.md).

Read from the source with ``ast``: module-level and function-level imports alike, since a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lattica"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    return {_module_name(f): _imported(f) for f in files}


def _imports_of(graph: dict[str, set[str]], target: str) -> list[str]:
    return sorted(m for m, names in graph.items() if any(n == target or n.startswith(target + ".") for n in names))


def test_nothing_outside_the_cli_imports_the_cli() -> None:
    outside = [m for m in _imports_of(_graph(), "lattica.cli") if not m.startswith("lattica.cli")]
    assert outside == []


def test_the_cli_entry_point_is_imported_by_no_command() -> None:
    """``main`` (parser and dispatch) imports the commands; they never import it back."""
    assert [m for m in _imports_of(_graph(), "lattica.cli.main") if m != "lattica.cli.main"] == []
