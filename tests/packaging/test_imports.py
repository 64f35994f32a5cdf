"""Who may import what inside the product, and how large a module may grow (docs/architecture.md).

Read from the source with ``ast``: module-level and function-level imports alike, since a lazy
import is still a dependency; imports under ``if TYPE_CHECKING:`` are annotations only and do not
count for the layers and the cycles.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
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
    above = ("lattica.node", "lattica.control", "lattica.observability", "lattica.crdt", "lattica.dht",
             "lattica.coordination", "lattica.train", "lattica.cli")
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
ABOVE_TRAINING = ("lattica.cli", "lattica.node", "lattica.control", "lattica.observability", "lattica.training_node")


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
        "from lattica.train.engine.collective import Collective\n\n"
        "def f():\n    import lattica.cli.main\n"
    )
    assert _violations("train", NET_INTERFACES, ABOVE_TRAINING, package=tmp_path / "lattica") == [
        "lattica.train.probe imports lattica.cli.main",
        "lattica.train.probe imports lattica.net.tensors.transfer",
    ]


# -- the layers of docs/architecture.md, one folder (or foundation module) each ----------------

# bottom up: a module may import its own layer and the layers below, never one above
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("lattica", "lattica.errors", "lattica.config", "lattica.files", "lattica.decoding",
                    "lattica.client_slots", "lattica.diagnostics", "lattica.numerics")),
    ("network", ("lattica.net",)),
    ("shared state", ("lattica.crdt", "lattica.dht")),
    ("coordination", ("lattica.coordination",)),
    ("training", ("lattica.train",)),
    ("node interfaces", ("lattica.control", "lattica.observability")),
    ("composition", ("lattica.node", "lattica.training_node")),
    ("entry points", ("lattica.cli",)),
)
PUBLIC_REEXPORTS = ("lattica.training_node",)  # documented import paths kept for users (``open_node``)
MAX_LINES = 500


def _runtime_targets(path: Path, known: set[str]) -> set[str]:
    """Like ``_targets``, leaving out the imports under ``if TYPE_CHECKING:``."""

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _names_type_checking(child.test):
                for other in child.orelse:
                    yield other
                    yield from walk(other)
                continue
            yield child
            yield from walk(child)

    targets: set[str] = set()
    for node in walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                targets.add(name if name in known else node.module)
    return {t for t in targets if t in known}


def _names_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    def name_of(path: Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = sorted(package.rglob("*.py"))
    known = {name_of(f) for f in files}
    return {name_of(f): _runtime_targets(f, known) - {name_of(f)} for f in files}


def _layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the longest prefix naming ``module`` (``lattica`` alone is exact)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or (prefix != "lattica" and module.startswith(prefix + "."))) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return best[0] if best is not None else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_belongs_to_a_layer() -> None:
    assert [m for m in _runtime_graph() if _layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, targets in sorted(_runtime_graph().items()):
        for target in sorted(targets):
            layer, theirs = _layer_of(module), _layer_of(target)
            if layer is not None and theirs is not None and theirs > layer:
                upward.append(f"{module} ({LAYERS[layer][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert upward == []


def test_no_files_import_each_other_in_a_circle() -> None:
    assert _cycles(_runtime_graph()) == []


def test_the_cycle_scan_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    """A circle closed by a function-level import is found; one closed under TYPE_CHECKING is not."""
    package = tmp_path / "lattica"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from lattica.b import f\n")
    (package / "b.py").write_text("def f():\n    from lattica import a\n")  # closes a -> b -> a
    (package / "c.py").write_text("from lattica.a import f\nfrom lattica.d import g\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lattica.c import f\n")
    assert _cycles(_runtime_graph(package)) == [["lattica.a", "lattica.b"]]


def test_observability_is_metrics_only_and_knows_nothing_of_the_node() -> None:
    """The node feeds its metrics; the metrics never reach back (not even for annotations)."""
    assert _violations("observability", frozenset({"lattica.net"}), ("lattica.node", "lattica.cli")) == []
    assert {p.stem for p in (PACKAGE / "observability").glob("*.py")} == {
        "__init__", "exporter", "http_request", "metrics", "traffic",
    }


def test_the_node_package_is_the_only_composition_layer() -> None:
    """Only ``node/`` wires the network half to the training half, and only the entry points (and
    ``open_node``'s public import path) build on it."""
    graph = _runtime_graph()
    users = sorted(m for m, targets in graph.items() if any(_within(t, ("lattica.node",)) for t in targets)
                   and not _within(m, ("lattica.node", "lattica.cli", *PUBLIC_REEXPORTS)))
    assert users == []
    wiring = sorted(m for m, targets in graph.items()
                    if any(_within(t, ("lattica.net",)) for t in targets)
                    and any(_within(t, ("lattica.train",)) for t in targets))
    assert [m for m in wiring if not _within(m, ("lattica.node", "lattica.cli"))] == []


def test_the_top_level_modules_are_the_foundation() -> None:
    """The modules beside the folders import no folder of the package: the layers are the folders."""
    graph = _runtime_graph()
    top = {_module_name(p) for p in PACKAGE.glob("*.py")} - set(PUBLIC_REEXPORTS)
    reaching = {m: sorted(t for t in graph[m] if _layer_of(t) != 0 or t.count(".") > 1) for m in sorted(top)}
    assert {m: targets for m, targets in reaching.items() if targets} == {}


def test_no_module_is_over_500_lines() -> None:
    """A signal to split: a module that grows past this holds more than one concern."""
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sorted(name for name, lines in lengths.items() if lines > MAX_LINES) == []


# -- a daemon that does not train does not load torch ------------------------------------------

# The modules ``lattica join`` runs through whether or not it trains. What they import at module
# level is loaded by every daemon; the training stack (torch, ``lattica.train``, the tensor data
# plane) only inside the functions that build a trainer. The real-process check of this is
# ``tests/daemon/test_idle_without_torch.py``; this one names the import that broke it.
IDLE_DAEMON_ROOTS = ("lattica.cli.main", "lattica.cli.commands", "lattica.node.daemon")
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


# -- the training package: engine, strategies, settings, swarm, service ------------------------

ENGINE = ("lattica.train.engine",)
# what the engine may not reach, directly or through what it imports (annotations included): it
# trains alone (``lattica.train.api.wrap``, ``benchmarks/convergence.py``), without a node
NOT_FOR_THE_ENGINE = (
    "lattica.train.swarm", "lattica.train.settings", "lattica.train.service", "lattica.train.status",
    "lattica.train.ports", "lattica.node", "lattica.training_node", "lattica.cli", "lattica.control",
    "lattica.observability", "lattica.net", "lattica.crdt", "lattica.dht",
)


def _reached_from(graph: dict[str, set[str]], roots: Iterable[str]) -> dict[str, str]:
    """Every package module reached from ``roots`` by imports -> the module that imports it."""
    by: dict[str, str] = {}
    todo = sorted(roots)
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target.startswith("lattica") and target not in by and target not in roots:
                by[target] = module
                todo.append(target)
    return by


def test_the_engine_reaches_no_swarm_settings_or_daemon() -> None:
    graph = _graph()
    engine = [m for m in graph if _within(m, ENGINE)]
    assert len(engine) > 10
    reached = _reached_from(graph, engine)
    assert sorted(f"{by} imports {t}" for t, by in reached.items() if _within(t, NOT_FOR_THE_ENGINE)) == []


def test_the_engine_scan_follows_imports_of_imports() -> None:
    graph = {"lattica.train.engine.a": {"lattica.train.strategies.b"}, "lattica.train.strategies.b": {"lattica.net.c"}}
    reached = _reached_from(graph, ["lattica.train.engine.a"])
    assert reached == {
        "lattica.train.strategies.b": "lattica.train.engine.a", "lattica.net.c": "lattica.train.strategies.b",
    }


def test_the_training_folders_import_only_downwards() -> None:
    """engine < strategies < settings < ports < swarm < the service (``service``, ``status``, ``api``):
    a folder imports its own and those before it (the engine runs the strategies' interface,
    ``strategies.base``, and the strategies build on the engine's modules: one level, two folders)."""
    order = ("lattica.train.engine", "lattica.train.strategies", "lattica.train.settings", "lattica.train.ports",
             "lattica.train.swarm")
    rank = {prefix: index for index, prefix in enumerate(order)}

    def rank_of(module: str) -> int:
        return next((rank[p] for p in order if _within(module, (p,))), len(order))

    upward = []
    for module, targets in sorted(_runtime_graph().items()):
        for target in sorted(targets):
            if not _within(module, ("lattica.train",)) or not _within(target, ("lattica.train",)):
                continue
            if rank_of(target) > rank_of(module) and not (
                _within(module, ENGINE) and target == "lattica.train.strategies.base"
            ):
                upward.append(f"{module} imports {target}")
    assert upward == []


MAX_ANY = 60  # occurrences of the word ``Any`` in the package: typed messages and states instead


def test_the_package_names_any_fewer_than_60_times() -> None:
    count = sum(len(re.findall(r"\bAny\b", p.read_text())) for p in PACKAGE.rglob("*.py"))
    assert count < MAX_ANY, f"{count} occurrences of Any in lattica/ (at most {MAX_ANY - 1})"
