"""Who may import what inside the product (see docs/architecture.md).

Read from the source with ``ast``: module-level and function-level imports alike, since a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
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


def test_the_network_layer_imports_nothing_above_it() -> None:
    """``net/`` (host, connectivity, NAT traversal, data plane) is built on by the services
    and the composition root; it never reaches up into them (docs/architecture.md)."""
    above = ("lattica.node", "lattica.daemon", "lattica.services", "lattica.nat_service", "lattica.control",
             "lattica.observability", "lattica.crdt", "lattica.dht", "lattica.coordination", "lattica.train",
             "lattica.cli", "lattica.demo", "lattica.progress")
    graph = _graph()
    upward = sorted({m for target in above for m in _imports_of(graph, target) if m.startswith("lattica.net")})
    assert upward == []


# -- training reaches the network only through its interfaces ---------------------------------

# Training imports nothing of ``lattica.net``: the pure tensor math it shares with the data plane
# (encodings and their sizes, the sparse payloads, the contribution screen) lives in
# ``lattica.numerics``; hosts, streams and the tensor service are built by the composition root
# and handed to training as a ``Collective`` or a ``GroupProvider`` (``lattica.coordination``).
NET_INTERFACES: frozenset[str] = frozenset()
NUMERICS = ("lattica.numerics.codecs", "lattica.numerics.sparse", "lattica.numerics.screen")
# the layers above training: it may not import them (they import it)
ABOVE_TRAINING = (
    "lattica.cli", "lattica.daemon", "lattica.node", "lattica.services", "lattica.control",
    "lattica.observability", "lattica.nat_service", "lattica.training_node", "lattica.demo",
)


def _targets(path: Path, known: set[str]) -> set[str]:
    """The modules ``path`` imports: for ``from package import name``, ``package.name`` when
    that is a module (in ``known``), else ``package``."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                targets.add(name if name in known else node.module)
    return targets


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(
    subpackage: str, allowed_net: frozenset[str], forbidden: tuple[str, ...], *, package: Path = PACKAGE,
) -> list[str]:
    """``module imports target`` for each import of ``lattica.<subpackage>`` that reaches into
    ``lattica.net`` outside ``allowed_net`` or into ``forbidden``."""

    def name_of(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    known = {name_of(f) for f in package.rglob("*.py")} | {_module_name(f) for f in PACKAGE.rglob("*.py")}
    found = []
    for path in sorted((package / subpackage).rglob("*.py")):
        for target in sorted(_targets(path, known)):
            if (_within(target, ("lattica.net",)) and target not in allowed_net) or _within(target, forbidden):
                found.append(f"{name_of(path)} imports {target}")
    return found


def test_training_reaches_the_network_only_through_its_interfaces() -> None:
    assert _violations("train", NET_INTERFACES, ABOVE_TRAINING) == []


def test_the_numerics_training_shares_with_the_data_plane_are_pure() -> None:
    """No I/O behind them: they import nothing of the package but the error taxonomy."""
    known = {_module_name(f) for f in PACKAGE.rglob("*.py")}
    for name in NUMERICS:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        own = {t for t in _targets(path, known) if _within(t, ("lattica",))}
        assert own <= {"lattica.errors"}, (name, own)


def test_coordination_knows_nothing_of_training() -> None:
    """``GroupProvider`` implementations sit below training: strategies use them, not the reverse."""
    assert _violations("coordination", frozenset({"lattica.net.wire"}), ("lattica.train", *ABOVE_TRAINING)) == []


def test_the_scan_finds_what_it_forbids(tmp_path: Path) -> None:
    """The rules above fail on a violation, lazy imports included (a scan that finds nothing
    would pass them all)."""
    probe = tmp_path / "lattica" / "train" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "from lattica.net.tensors import transfer\nfrom lattica.numerics import codecs\n"
        "from lattica.train.collective import Collective\n\n"
        "def f():\n    import lattica.cli.main\n"
    )
    assert _violations("train", NET_INTERFACES, ABOVE_TRAINING, package=tmp_path / "lattica") == [
        "lattica.train.probe imports lattica.cli.main",
        "lattica.train.probe imports lattica.net.tensors.transfer",
    ]


# -- a daemon that does not train does not load torch ------------------------------------------

# The modules ``lattica join`` runs through whether or not it trains. What they import at module
# level is loaded by every daemon; the training stack (torch, ``lattica.train``, the tensor data
# plane) only inside the functions that build a trainer. The real-process check of this is
# ``tests/daemon/test_idle_without_torch.py``; this one names the import that broke it.
IDLE_DAEMON_ROOTS = ("lattica.cli.main", "lattica.cli.commands", "lattica.daemon")
TRAINING_STACK = ("torch", "numpy", "lattica.train", "lattica.net.tensors", "lattica.numerics.screen",
                  "lattica.numerics.codecs", "lattica.numerics.sparse", "lattica.numerics.partner_screen")


def _module_level_targets(path: Path, known: set[str]) -> set[str]:
    """What ``path`` imports when it is imported: module-level statements (``if``/``try``
    blocks included), not function bodies nor ``if TYPE_CHECKING:`` blocks."""
    targets: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    targets.add(name if name in known else node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return targets


def _loaded_at_import(roots: Iterable[str], package: Path = PACKAGE) -> dict[str, str]:
    """Every module imported by importing ``roots`` -> the package module that imports it."""
    def path_of(name: str) -> Path | None:
        base = package.parent / name.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
        return None

    def name_of(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    known = {name_of(f) for f in package.rglob("*.py")}
    by: dict[str, str] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        path = path_of(module)
        if path is None:
            continue
        parents = [".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)]
        for target in sorted(_module_level_targets(path, known) | set(parents)):
            if target not in by:
                by[target] = module
                if _within(target, ("lattica",)):
                    todo.append(target)
    return by


def test_the_idle_daemon_path_imports_no_training_stack() -> None:
    loaded = _loaded_at_import(IDLE_DAEMON_ROOTS)
    assert sorted(f"{by} imports {t}" for t, by in loaded.items() if _within(t, TRAINING_STACK)) == []


def test_the_idle_daemon_scan_follows_module_level_imports_only(tmp_path: Path) -> None:
    package = tmp_path / "lattica"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nimport lattica.b\nif TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import numpy\n"
    )
    (package / "b.py").write_text("try:\n    import torch\nexcept ImportError:\n    pass\n")
    loaded = _loaded_at_import(("lattica.a",), package=package)
    assert loaded.get("torch") == "lattica.b"
    assert "numpy" not in loaded
