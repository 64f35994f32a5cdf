"""The node daemon: one libp2p host and the services of a training run, in one nursery.

Theory of operation: ``Node.run`` binds the host (TCP + Noise + Yamux, every stream through the
run's access gate), starts the metrics exporter and the control socket, then its
``Connectivity`` (``lattica.net.connectivity``: bootstrap, redial, peer exchange, the NAT
traversal and dialer choice). Once bootstrap succeeded the services are built — by the
``ServiceBuilder`` the node was given, from a ``NodeContext`` of the running node's parts — and
started in order, each a child of the one nursery. Shutdown (``request_shutdown``, e.g. from
SIGTERM) first lets the services say goodbye (``GracefulStop``), then tells connected peers,
then cancels the nursery, then closes the host.

Start-up fails with ``ConfigError`` — one line for the user — when a listen port is taken or
no bootstrap peer answers within ``bootstrap_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.crypto.keys import KeyPair
from trio_typing import TaskStatus

from lattica import __version__
from lattica.config import DEFAULT_METRICS_ADDR, NodeConfig, parse_host_port, parse_multiaddr
from lattica.control.protocol import ControlRequest
from lattica.control.server import ControlServer, ensure_no_daemon
from lattica.errors import ConfigError, LocalProtocolError
from lattica.net.access import AccessGate, AccessStatus, RunAccess
from lattica.net.bootstrap import JoinOutcome
from lattica.net.clock import CLOCK_PROTOCOL, answer_clock
from lattica.net.connectivity import Connectivity
from lattica.net.host import AnnouncementWatcher, LatticaHost, build_host, stop_auto_connector
from lattica.net.identity import peer_id_of
from lattica.net.peerbook import PeerBook
from lattica.net.wire import ByteStream
from lattica.node.doctor import node_facts
from lattica.node.services import (
    ControlHandler,
    GracefulStop,
    NodeContext,
    NodeService,
    PeerTableSource,
    ServiceBuilder,
    StatusSource,
)
from lattica.observability import MeteredStream, MetricsServer, NodeMetrics

log = logging.getLogger(__name__)

_METRICS_PORT_SEARCH = 99  # the default metrics port and the next ones, for daemons side by side
_SERVICE_GOODBYE_S = 1.0
_GOODBYE_BUDGET_S = 2.5  # with 1 s for the services' own goodbyes: within the 5 s of lattica.node.daemon


def _no_services(context: NodeContext) -> Sequence[NodeService]:
    return ()


class Node:
    def __init__(
        self, config: NodeConfig, key_pair: KeyPair, *, secret: bytes | None = None,
        services: ServiceBuilder = _no_services,
    ) -> None:
        self.config = config
        self.key_pair = key_pair
        self.peer_id = peer_id_of(key_pair)
        self.access = AccessGate(
            RunAccess(
                run_id=config.run_id, self_id=self.peer_id.to_base58(),
                allow_peers=frozenset(config.allow_peers), secret=secret,
            )
        )
        self.peer_book = PeerBook(self.peer_id.to_base58())
        self.started_at = time.time()
        self.host: LatticaHost | None = None
        self.connectivity: Connectivity | None = None
        self._build_services = services
        self.services: tuple[NodeService, ...] = ()  # built once bootstrap succeeded
        self._shutdown = trio.Event()
        self.metrics = NodeMetrics(peer_id=self.peer_id.to_base58(), run_id=config.run_id)
        self.metrics_addr: str | None = None  # HOST:PORT the exporter listens on, once it does

    # -- lifecycle -------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        self._shutdown.set()

    @property
    def shutdown_requested(self) -> bool:
        return self._shutdown.is_set()

    async def wait_for_shutdown_request(self) -> None:
        await self._shutdown.wait()

    @property
    def running_host(self) -> LatticaHost:
        """The libp2p host, which exists only while ``run`` is active."""
        if self.host is None:
            raise RuntimeError("the node's host exists only while Node.run is active")
        return self.host

    @property
    def running_connectivity(self) -> Connectivity:
        if self.connectivity is None:
            raise RuntimeError("the node's connectivity exists only while Node.run is active")
        return self.connectivity

    async def run(self, *, task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        listen = [parse_multiaddr(a, what="--listen") for a in self.config.listen]
        announce = [parse_multiaddr(a, what="--announce") for a in self.config.announce]
        # before binding anything: a second daemon on this data dir must not disturb the first
        await ensure_no_daemon(self.config.control_socket)
        _check_ports_free(listen)
        self.config.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # every run protocol registered from now on is members-only
        host = build_host(self.key_pair, listen_addrs=listen, announce_addrs=announce, guard=self.access)
        self.host = host
        self.access.attach(host)
        connectivity = self.connectivity = Connectivity(
            host, self.config, access=self.access, peer_book=self.peer_book, metrics=self.metrics,
            meter=self._metered, nat=self.config.nat,
        )
        async with host.run(listen):
            await stop_auto_connector(host)
            if len(host.get_transport_addrs()) < len(listen):
                raise ConfigError(f"could not listen on all of {', '.join(self.config.listen)} (port in use?)")
            host.set_stream_handler(CLOCK_PROTOCOL, answer_clock)  # for peers' `lattica doctor`
            async with trio.open_nursery() as nursery:
                # protocols registered later (DHT, state, training) and relay addresses
                # reach the peers that identified us before: identify push
                await nursery.start(AnnouncementWatcher(host).run)
                await self._start_metrics(nursery)
                await nursery.start(ControlServer(self.config.control_socket, self._handle_control).run)
                await nursery.start(connectivity.run)
                self.services = tuple(self._build_services(self._context(host, connectivity)))
                for service in self.services:
                    log.debug("starting service %s", service.name)
                    await nursery.start(service.run)
                task_status.started(self)
                await self._shutdown.wait()
                log.info("shutting down")
                with trio.move_on_after(_SERVICE_GOODBYE_S):
                    for service in self.services:
                        if isinstance(service, GracefulStop):
                            await service.on_shutdown()
                with trio.move_on_after(_GOODBYE_BUDGET_S):
                    await connectivity.say_goodbye()
                log.info("goodbyes said; stopping the services")
                nursery.cancel_scope.cancel()
            log.info("services stopped; closing the host")
        log.info("host closed")

    def _context(self, host: LatticaHost, connectivity: Connectivity) -> NodeContext:
        return NodeContext(
            config=self.config, key_pair=self.key_pair, peer_id=self.peer_id, host=host,
            peer_book=self.peer_book, connectivity=connectivity, metrics=self.metrics,
        )

    def _metered(self, stream: INetStream, protocol: str) -> ByteStream:
        return MeteredStream(stream, self.metrics, protocol)

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        """The Prometheus exporter. The default address is shared by every daemon of a machine:
        when another has it, the next free port is used and named (log, ``lattica status``); a
        taken address the user chose is an error."""
        if self.config.metrics_addr is None:
            return
        host, port = parse_host_port(self.config.metrics_addr, what="--metrics-addr")
        search = _METRICS_PORT_SEARCH if self.config.metrics_addr == DEFAULT_METRICS_ADDR else 0
        exporter = MetricsServer(self.metrics, host, port, port_search=search)
        _, bound = await nursery.start(exporter.run)
        self.metrics_addr = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        if bound != port:
            log.warning(
                "metrics address %s is taken (another daemon?); serving metrics on http://%s/metrics",
                self.config.metrics_addr, self.metrics_addr,
            )

    # -- what connectivity knows, for the CLI and the control API --------------------------------

    def dialable_addrs(self) -> list[str]:
        return self.running_connectivity.dialable_addrs()

    async def dial_peer(self, peer_id: str, addrs: Sequence[str] = ()) -> bool:
        return await self.running_connectivity.dial_peer(peer_id, addrs)

    @property
    def joined(self) -> JoinOutcome:
        return self.connectivity.joined if self.connectivity is not None else JoinOutcome()

    @property
    def bootstrap_errors(self) -> dict[str, str]:
        return self.connectivity.bootstrap_errors if self.connectivity is not None else {}

    def join_summary(self) -> str:
        """One line on what start-up joined, for the user."""
        if self.connectivity is not None:
            return self.connectivity.join_summary()
        return self.joined.summary(self.config.run_id)

    # -- control API ---------------------------------------------------------------------

    def statistics(self) -> NodeStatus:
        """The node's own part of ``lattica status`` (the services add theirs: ``StatusSource``)."""
        return NodeStatus(
            peer_id=self.peer_id.to_base58(),
            version=__version__,
            run_id=self.config.run_id,
            pid=os.getpid(),
            uptime_s=round(time.time() - self.started_at, 1),
            addrs=tuple(self.dialable_addrs()),
            connected_peers=len(self.peer_book.connected_ids()),
            known_peers=len(self.peer_book.records()),
            joined=self.join_summary(),
            metrics_addr=self.metrics_addr,
            access=self.access.statistics(),
        )

    def status(self) -> dict[str, object]:
        """``lattica status``: the node's own keys, then each ``StatusSource`` service's."""
        status = self.statistics().as_json()
        for service in self.services:
            if isinstance(service, StatusSource):
                status.update(service.status())
        return status

    async def _handle_control(self, request: ControlRequest) -> object:
        if request.method == "status":
            return self.status()
        if request.method == "id":
            return {"peer_id": self.peer_id.to_base58(), "addrs": self.dialable_addrs()}
        if request.method == "peers":
            for service in self.services:  # paths and RTTs as the connections are now
                if isinstance(service, PeerTableSource):
                    service.refresh_peer_table()
            return [r.as_json() for r in self.peer_book.records()]
        if request.method == "shutdown":
            self.request_shutdown()
            return {"stopping": True}
        if request.method == "doctor":  # served here: it must answer while bootstrap still runs
            facts = await node_facts(self.running_host, self.running_connectivity, self.config, self.services)
            return asdict(facts)
        for service in self.services:
            if isinstance(service, ControlHandler):
                result = await service.handle_control(request)
                if result is not None:
                    return result
        raise LocalProtocolError(f"this daemon does not serve {request.method!r}")


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    peer_id: str
    version: str
    run_id: str
    pid: int
    uptime_s: float
    addrs: tuple[str, ...]  # where others can join through this node
    connected_peers: int
    known_peers: int
    joined: str  # what start-up joined, in one line
    metrics_addr: str | None  # HOST:PORT of the metrics exporter, None when off
    access: AccessStatus

    def as_json(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id, "version": self.version, "run_id": self.run_id, "pid": self.pid,
            "uptime_s": self.uptime_s, "addrs": list(self.addrs), "connected_peers": self.connected_peers,
            "known_peers": self.known_peers, "joined": self.joined, "metrics_addr": self.metrics_addr,
            "access": self.access.as_json(),
        }


def _check_ports_free(listen: list[multiaddr.Multiaddr]) -> None:
    """Fail early when a fixed listen port is taken.

    py-libp2p binds with SO_REUSEPORT and only logs a failed listener, so two daemons could
    silently share a port. A plain bind without SO_REUSEPORT tells whether anyone holds it.
    """
    for addr in listen:
        parts = str(addr).split("/")
        family, ip, port = parts[1], parts[2], int(parts[4])
        if port == 0:
            continue
        af = socket.AF_INET6 if family == "ip6" else socket.AF_INET
        try:
            with socket.socket(af, socket.SOCK_STREAM) as s:
                # SO_REUSEADDR passes over TIME_WAIT leftovers of a previous run, but not over
                # a live listener (which would need SO_REUSEPORT on both sides)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if af == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((ip, port))
        except OSError as exc:
            if exc.errno == 99 or exc.errno == 97:  # EADDRNOTAVAIL / EAFNOSUPPORT
                raise ConfigError(f"cannot listen on {addr}: {exc.strerror}") from None
            raise ConfigError(f"cannot listen on {addr}: port {port} is in use") from None
