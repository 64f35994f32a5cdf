"""A node's services: built once bootstrap succeeded, from the ``NodeContext``, started in the
builder's order, and reached only through the Protocols they implement (``lattica.node.services``).

A real node on loopback with a real control socket, asked the way ``lattica status``, ``lattica
peers`` and ``lattica stop`` ask it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.config import NodeConfig
from lattica.control.client import call
from lattica.control.protocol import ControlRequest
from lattica.diagnostics import NodeFacts
from lattica.errors import LatticaError
from lattica.node.node import Node
from lattica.node.services import (
    ControlHandler,
    DoctorSource,
    GracefulStop,
    NodeContext,
    NodeService,
    PeerTableSource,
    StatusSource,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lattica"


class _Full:
    """Implements every optional Protocol."""

    name = "full"

    def __init__(self, context: NodeContext, log: list[str]) -> None:
        self.context, self.log = context, log
        self.addrs_at_build = context.dialable_addrs()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.log.append("full started")
        task_status.started()
        await trio.sleep_forever()

    def status(self) -> dict[str, object]:
        return {"full": {"peer_id": self.context.peer_id.to_base58()}}

    async def handle_control(self, request: ControlRequest) -> object | None:
        return {"echo": request.params} if request.method == "state" else None

    async def on_shutdown(self) -> None:
        self.log.append("full goodbye")

    def refresh_peer_table(self) -> None:
        self.log.append("peer table refreshed")


class _Plain:
    """Only a name and run: nothing else is asked of it."""

    name = "plain"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.log.append("plain started")
        task_status.started()
        await trio.sleep_forever()


def test_the_protocols_tell_the_services_apart() -> None:
    full, plain = _Full.__new__(_Full), _Plain([])
    assert isinstance(full, NodeService)
    assert isinstance(plain, NodeService)
    assert all(isinstance(full, p) for p in (StatusSource, ControlHandler, GracefulStop, PeerTableSource))
    assert not any(isinstance(plain, p) for p in (StatusSource, ControlHandler, GracefulStop, PeerTableSource))


async def test_services_are_built_after_bootstrap_started_in_order_and_asked_through_their_protocols(tmp_path) -> None:
    log: list[str] = []
    built: list[NodeService] = []

    def services(context: NodeContext) -> list[NodeService]:
        log.append("built")
        built[:] = [_Full(context, log), _Plain(log)]
        return built

    config = NodeConfig(data_dir=tmp_path / "n", listen=("/ip4/127.0.0.1/tcp/0",), metrics_addr=None,
                        nat=False, dht=False)
    node = Node(config, create_new_key_pair(), services=services)
    sock = config.control_socket
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            assert log == ["built", "full started", "plain started"]
            assert built[0].addrs_at_build == node.dialable_addrs() != []  # connectivity ran first
            assert node.services == tuple(built)

            status = await trio.to_thread.run_sync(call, sock, "status")
            assert status["full"] == {"peer_id": node.peer_id.to_base58()}
            assert status["peer_id"] == node.peer_id.to_base58()
            assert await trio.to_thread.run_sync(call, sock, "state", {"x": 1}) == {"echo": {"x": 1}}
            with pytest.raises(LatticaError, match="does not serve 'train'"):  # no service answered
                await trio.to_thread.run_sync(call, sock, "train")
            await trio.to_thread.run_sync(call, sock, "peers")
            assert log.count("peer table refreshed") == 1

            await trio.to_thread.run_sync(call, sock, "shutdown")
    assert log[-1] == "full goodbye"


class _Reachable:
    """A service that knows this node's reachability and a peer's, for ``lattica doctor``."""

    name = "reachable"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def doctor_facts(self, facts: NodeFacts) -> NodeFacts:
        return dataclasses.replace(facts, reachability="public", relay_serving=True)


async def test_the_doctor_request_asks_every_doctor_source(tmp_path) -> None:
    """The node's own facts first, then each ``DoctorSource`` adds its part, in start order."""
    assert isinstance(_Reachable(), DoctorSource)
    assert not isinstance(_Plain([]), DoctorSource)
    config = NodeConfig(data_dir=tmp_path / "n", listen=("/ip4/127.0.0.1/tcp/0",), metrics_addr=None,
                        nat=False, dht=False)
    node = Node(config, create_new_key_pair(), services=lambda context: [_Plain([]), _Reachable()])
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            facts = await trio.to_thread.run_sync(call, config.control_socket, "doctor")
            assert facts["peer_id"] == node.peer_id.to_base58()
            assert facts["advertised"] == node.dialable_addrs() != []
            assert (facts["reachability"], facts["relay_serving"]) == ("public", True)
            node.request_shutdown()


def _calls(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names]


def test_the_node_and_the_composition_root_do_not_probe_their_services() -> None:
    """Optional features are declared by Protocols, not discovered with getattr/hasattr."""
    probing = {"getattr", "hasattr", "setattr"}
    for path in sorted((PACKAGE / "node").glob("*.py")):
        assert _calls(path, probing) == []
