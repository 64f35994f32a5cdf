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
    above = ("lattica.node", "lattica.control",
             "lattica.observability", "lattica.crdt", "lattica.dht", "lattica.coordination", "lattica.train",
             "lattica.cli")
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
    "lattica.cli", "lattica.node", "lattica.control", "lattica.observability", "lattica.training_node",
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
