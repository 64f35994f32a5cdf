"""Lattica's reliance on py-libp2p internals (``lattica.net.libp2p_compat``), held against the
installed library: every private name it uses exists with the shape it expects, on real hosts
and connections, and nothing else in ``lattica`` touches one. An upgrade of py-libp2p that moves
a name fails here, naming it, instead of silently turning a hook off."""

from __future__ import annotations

import ast
import inspect
from importlib import metadata
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.exceptions import MultiError
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.identity.identify import identify
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.network.swarm import Swarm
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2 import dcutr
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

from lattica.net import libp2p_compat
from lattica.net.host import build_host
from lattica.net.libp2p_compat import (
    COMPATIBLE_VERSION,
    DCUtRHooks,
    auto_connector,
    connection_observations,
    hop_stream_handler,
    identify_message,
    nested_errors,
    tcp_listen_endpoints,
    tcp_socket_of,
)
from lattica.net.nat.observations import observations

PACKAGE = Path(__file__).resolve().parents[2] / "lattica"
LIBP2P = Path(inspect.getfile(DCUtRProtocol)).parents[2]
LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")

# (owner, private name, its parameters): the hooks Lattica overrides or calls
PRIVATE_CALLABLES = [
    (DCUtRProtocol, "_auto_drive_loop", ["self"]),
    (DCUtRProtocol, "_try_unilateral_upgrade", ["self", "peer_id"]),
    (DCUtRProtocol, "_perform_hole_punch", ["self", "peer_id", "addrs", "as_responder"]),
    (DCUtRProtocol, "_verify_direct_connection", ["self", "peer_id"]),
    (DCUtRProtocol, "_dial_peer", ["self", "peer_id", "addr", "source", "as_responder"]),
    (DCUtRProtocol, "_schedule_relay_close", ["self", "peer_id"]),
    (AutoNATService, "_try_dial", ["self", "peer_id", "addrs"]),
    (PeerRouting, "_query_single_peer_for_closest", ["self", "peer", "target_key", "new_peers"]),
    (CircuitV2Protocol, "_handle_hop_stream", ["self", "stream"]),
    (Swarm, "unblock_peer", ["self", "peer_id"]),
    (dcutr, "_local_tcp_listen_addrs", ["host"]),
    (identify, "_mk_identify_protobuf", ["host", "observed_multiaddr"]),
]


def test_the_installed_py_libp2p_is_the_version_the_compat_module_was_checked_against() -> None:
    installed = metadata.version("libp2p")
    assert installed == COMPATIBLE_VERSION, (
        f"py-libp2p {installed} is installed; lattica/net/libp2p_compat.py was checked against "
        f"{COMPATIBLE_VERSION}: check each reliance it lists, then update COMPATIBLE_VERSION"
    )


@pytest.mark.parametrize(("owner", "name", "parameters"), PRIVATE_CALLABLES,
                         ids=[f"{o.__name__}.{n}" for o, n, _ in PRIVATE_CALLABLES])
def test_every_private_hook_and_function_exists_with_its_parameters(
    owner: object, name: str, parameters: list[str],
) -> None:
    found = getattr(owner, name, None)
    assert found is not None, f"py-libp2p no longer has {getattr(owner, '__name__', owner)}.{name}"
    assert list(inspect.signature(found).parameters) == parameters, f"{name} changed its parameters"


def test_the_hooks_forward_to_every_private_method_they_replace() -> None:
    """Each base class of the compat module overrides the library's hook by the same name."""
    for hooks, library in ((DCUtRHooks, DCUtRProtocol), (libp2p_compat.AutoNATHooks, AutoNATService),
                           (libp2p_compat.PeerRoutingHooks, PeerRouting)):
        replaced = [n for n, v in vars(hooks).items() if n.startswith("_") and not n.startswith("__") and callable(v)]
        assert replaced
        for name in replaced:
            assert name in vars(library), f"{library.__name__}.{name} is gone: {hooks.__name__} overrides nothing"


async def test_the_private_state_lattica_reads_is_there_on_a_real_host() -> None:
    host = build_host(create_new_key_pair(), listen_addrs=[LOOPBACK])
    async with host.run([LOOPBACK]):
        manager = getattr(host, "_observed_addr_manager", None)
        assert manager is not None, "BasicHost._observed_addr_manager is gone"
        assert isinstance(getattr(manager, "_conn_observations", None), dict), "_conn_observations is gone"
        assert callable(getattr(manager, "addrs", None))
        assert auto_connector(host) is not None, "Swarm.auto_connector is gone"
        assert identify_message(host).protocols
        assert tcp_listen_endpoints(host)[0][0] == "127.0.0.1"
        punch = DCUtRHooks(host)
        assert isinstance(getattr(punch, "_in_progress", None), set), "DCUtRProtocol._in_progress is gone"
        assert isinstance(getattr(punch, "_hole_punch_attempts", None), dict), "_hole_punch_attempts is gone"
        assert callable(hop_stream_handler(CircuitV2Protocol(host, allow_hop=True)))


async def test_a_real_connection_leads_to_its_socket_and_to_what_the_peer_observed() -> None:
    a = build_host(create_new_key_pair(), listen_addrs=[LOOPBACK])
    b = build_host(create_new_key_pair(), listen_addrs=[LOOPBACK])
    async with a.run([LOOPBACK]), b.run([LOOPBACK]):
        await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
        conn = a.get_network().connections[b.get_id()][0]
        sock = tcp_socket_of(conn)
        assert isinstance(sock, trio.SocketStream), "the layers under a connection no longer lead to its socket"
        assert sock.socket.getpeername()[1] == int(str(b.get_addrs()[0]).split("/")[4])
        # the manager ignores loopback sightings: record one as a peer behind a NAT would report it
        seen = multiaddr.Multiaddr("/ip4/198.51.100.7/tcp/40001")
        a._observed_addr_manager.record_observation(conn, seen, a.get_transport_addrs())  # type: ignore[attr-defined]
        assert connection_observations(a) == [(str(seen), conn)]
        [observation] = observations(a)
        assert (observation.observer, observation.observed) == (str(b.get_id()), "198.51.100.7:40001")
        assert observation.local == f"127.0.0.1:{sock.socket.getsockname()[1]}"


def test_nested_errors_reads_libp2p_multi_errors_and_exception_groups() -> None:
    inner = [OSError("refused"), TimeoutError("slow")]
    assert nested_errors(MultiError(inner)) == inner
    assert nested_errors(ExceptionGroup("dial", inner)) == inner
    assert nested_errors(OSError("plain")) == []


def _libp2p_private_names() -> set[str]:
    names: set[str] = set()
    for path in LIBP2P.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(path: Path, private: set[str], hooks: set[str]) -> list[str]:
    """``path``'s uses of py-libp2p's private names: imports, attributes, getattr, and the
    methods of a py-libp2p subclass that override one (``hooks``: every private name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_libp2p = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").split(".")[0] == "libp2p" for a in node.names}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "libp2p":
            names = [a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            names = [node.attr]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            text = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            names = [text] if isinstance(text, str) and text in private else []
        elif isinstance(node, ast.ClassDef) and {b.id for b in node.bases if isinstance(b, ast.Name)} & from_libp2p:
            methods = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            names = [f.name for f in methods if f.name in hooks]
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}" for name in names]
    return found


def _own_names(skip: Path) -> set[str]:
    """Private names Lattica defines itself (a ``_drop`` of ours is not py-libp2p's)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def test_nothing_but_the_compat_module_touches_a_private_name_of_py_libp2p() -> None:
    compat = PACKAGE / "net" / "libp2p_compat.py"
    hooks = _libp2p_private_names()
    private = hooks - _own_names(skip=compat)
    found = _private_uses(compat, private, hooks)
    assert len(found) >= len(PRIVATE_CALLABLES), "the scan misses the compat module's uses"
    elsewhere = [use for path in sorted(PACKAGE.rglob("*.py")) if path != compat
                 for use in _private_uses(path, private, hooks)]
    assert elsewhere == []
