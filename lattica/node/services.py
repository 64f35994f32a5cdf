"""What a node service is, and what a service is given when it is built.

A node service is anything with a name and ``async run(*, task_status)``, started in the
node's nursery once the host runs and connectivity has bootstrapped (``NodeService``). What a
service adds beyond that it declares by implementing one of the small Protocols below, which
the node checks with ``isinstance``: a part of ``lattica status`` (``StatusSource``), control
requests (``ControlHandler``), a goodbye before the nursery is cancelled (``GracefulStop``),
fresh path and RTT figures for ``lattica peers`` (``PeerTableSource``), what it knows for
``lattica doctor`` (``DoctorSource``).

Services are built by one function, a ``ServiceBuilder``: it receives the ``NodeContext`` (the
running host and the node's own parts) and returns the services in the order they start, each
constructed with the narrow dependencies it needs — see ``lattica.node.composition.daemon_services``,
the composition root of ``lattica join``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.control.protocol import ControlRequest
from lattica.diagnostics import NodeFacts
from lattica.net.clock import measure_clocks
from lattica.net.connectivity import Connectivity
from lattica.net.host import LatticaHost
from lattica.net.peerbook import PeerBook
from lattica.observability import NodeMetrics


@runtime_checkable
class NodeService(Protocol):
    """A long-lived part of a node, run as a child of the node's nursery."""

    @property
    def name(self) -> str: ...

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


@runtime_checkable
class StatusSource(Protocol):
    """Adds keys to the node's ``status`` answer (``lattica status``)."""

    def status(self) -> dict[str, object]: ...


@runtime_checkable
class ControlHandler(Protocol):
    """Serves control requests the node does not serve itself; None: not mine."""

    async def handle_control(self, request: ControlRequest) -> object | None: ...


@runtime_checkable
class GracefulStop(Protocol):
    """Says goodbye (e.g. leaves the replicated state) before the nursery is cancelled."""

    async def on_shutdown(self) -> None: ...


@runtime_checkable
class PeerTableSource(Protocol):
    """Copies fresh per-peer figures (path, relay, RTT) into the peer book on demand."""

    def refresh_peer_table(self) -> None: ...


@runtime_checkable
class DoctorSource(Protocol):
    """Adds what the service knows to the node's ``doctor`` answer (``lattica doctor``)."""

    def doctor_facts(self, facts: NodeFacts) -> NodeFacts:
        """``facts`` with this service's part filled in."""
        ...


@dataclass(frozen=True)
class NodeContext:
    """The running node's parts a service may be given: built once the host runs."""

    config: NodeConfig
    key_pair: KeyPair
    peer_id: ID
    host: LatticaHost
    peer_book: PeerBook
    connectivity: Connectivity
    metrics: NodeMetrics

    def dialable_addrs(self) -> list[str]:
        return self.connectivity.dialable_addrs()

    async def round_trip_times(self, peers: Sequence[str]) -> dict[str, float]:
        """Seconds from us to each peer and back, from one clock query each (silent peers left out)."""
        return {p: 2 * c.error_s for p, c in (await measure_clocks(self.host, list(peers))).items()}


ServiceBuilder = Callable[[NodeContext], Sequence[NodeService]]

METRICS_INTERVAL_S = 2.0
"""How often a service copies its figures into the node's metrics."""
