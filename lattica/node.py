"""The node daemon: one libp2p host and the services of a training run, in one nursery.

Theory of operation: ``Node.run`` binds the host (TCP + Noise + Yamux), starts the control
socket, dials the bootstrap peers (``--peer``) and keeps them connected with exponential
backoff, and learns the rest of the run from peer exchange (and the DHT where enabled). Every
service is a child of one nursery; shutdown (``request_shutdown``, e.g. from SIGTERM) first
tells connected peers goodbye, then cancels the nursery, then closes the host.

Dialing: while no ``dialer`` is installed (start-up, or ``nat = false``) peers are dialed at their
direct addresses with ``host.connect``. The NAT services install a path dialer (direct first,
then the peer's ``/p2p-circuit`` relay addresses, then a hole punch to upgrade a relayed
connection); from then on every dial — bootstrap redials, peer exchange, DHT run members,
replicated-state members — goes through it with the peer's direct and relay addresses, so two
peers behind NATs reach each other. Relay addresses are accepted only when they end in the
peer's own id.

Start-up fails with ``ConfigError`` — one line for the user — when a listen port is taken or
no bootstrap peer answers within ``bootstrap_timeout_s``; after a successful start, losing the
bootstrap peers only triggers reconnection attempts.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from trio_typing import TaskStatus

from lattica import __version__
from lattica.config import DEFAULT_METRICS_ADDR, NodeConfig, parse_host_port, parse_multiaddr
from lattica.control.protocol import ControlRequest
from lattica.control.server import ControlServer, ensure_no_daemon
from lattica.errors import ConfigError, LatticaError, LocalProtocolError
from lattica.net.access import AccessGate, RunAccess
from lattica.net.addrs import dialable_addrs, peer_info_from_addr
from lattica.net.clock import CLOCK_PROTOCOL, answer_clock
from lattica.net.host import (
    AnnouncementWatcher,
    build_host,
    circuit_addr_for,
    peer_may_support,
    stop_auto_connector,
)
from lattica.net.identity import peer_id_of
from lattica.net.nat.circuit import dial_circuit
from lattica.net.peer_exchange import (
    BYE_PROTOCOL,
    MAX_REPLY_BYTES,
    PX_PROTOCOL,
    parse_px_reply,
    px_reply,
)
from lattica.net.peerbook import PeerBook
from lattica.net.wire import read_message, write_message
from lattica.observability import MeteredStream, MetricsServer, NodeMetrics

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_PX_INTERVAL_S = 2.0
_DIAL_TIMEOUT_S = 5.0
_PATH_DIAL_TIMEOUT_S = 15.0  # direct (3 s) then up to three relays in turn
_STREAM_TIMEOUT_S = 5.0
_METRICS_PORT_SEARCH = 99  # the default metrics port and the next ones, for daemons side by side
_IDENTIFY_WAIT_S = 3.0  # for a bootstrap peer's identify, to tell a Lattica node from others
_GOODBYE_BUDGET_S = 2.5  # with 1 s for the services' own goodbyes: within the 5 s of lattica.daemon


class PeerDialer(Protocol):
    """Reaches a peer over the best path its addresses allow (``lattica.net.nat.Dialer``)."""

    async def connect(self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr]) -> Any: ...


class Node:
    def __init__(self, config: NodeConfig, key_pair: KeyPair, *, secret: bytes | None = None) -> None:
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
        self.host: IHost | None = None
        self._shutdown = trio.Event()
        self._dialing: dict[str, bool] = {}  # peer -> the dial in flight includes relay addrs
        self._no_px: set[str] = set()  # connected peers that refused peer exchange
        self.joined = JoinOutcome()  # what bootstrap reached
        self.bootstrap_errors: dict[str, str] = {}  # bootstrap address -> why its last dial failed
        self.dialer: PeerDialer | None = None  # installed by the NAT services once they run
        # Services that need the running host are built from these factories once it exists;
        # each has run(task_status=...) and optionally status(), handle_control(), on_shutdown().
        self.service_factories: list[Callable[[Node], Any]] = []
        self.extensions: list[Any] = []
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
    def running_host(self) -> IHost:
        """The libp2p host, which exists only while ``run`` is active.

        Services are built from ``service_factories`` inside ``run``, after the host is up, so
        they may rely on it; anything earlier is a programming error, not a peer's fault.
        """
        if self.host is None:
            raise RuntimeError("the node's host exists only while Node.run is active")
        return self.host

    async def run(self, *, task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        listen = [parse_multiaddr(a, what="--listen") for a in self.config.listen]
        announce = [parse_multiaddr(a, what="--announce") for a in self.config.announce]
        # before binding anything: a second daemon on this data dir must not disturb the first
        await ensure_no_daemon(self.config.control_socket)
        _check_ports_free(listen)
        self.config.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        host = build_host(self.key_pair, listen_addrs=listen, announce_addrs=announce)
        self.host = host
        self.access.install(host)  # before any handler: every run protocol is members-only
        async with host.run(listen):
            await stop_auto_connector(host)
            if len(host.get_transport_addrs()) < len(listen):
                raise ConfigError(f"could not listen on all of {', '.join(self.config.listen)} (port in use?)")
            host.set_stream_handler(PX_PROTOCOL, self._handle_px)
            host.set_stream_handler(BYE_PROTOCOL, self._handle_bye)
            host.set_stream_handler(CLOCK_PROTOCOL, answer_clock)  # for peers' `lattica doctor`
            async with trio.open_nursery() as nursery:
                # protocols registered later (DHT, state, training) and relay addresses
                # reach the peers that identified us before: identify push
                await nursery.start(AnnouncementWatcher(host).run)
                await self._start_metrics(nursery)
                control = ControlServer(self.config.control_socket, self._handle_control)
                await nursery.start(control.run)
                nursery.start_soon(self._watch_connections)
                await self._bootstrap()
                for peer in self.config.peers:
                    nursery.start_soon(self._keep_connected, peer)
                if self.config.peer_exchange:
                    nursery.start_soon(self._peer_exchange_loop)
                self.extensions = [factory(self) for factory in self.service_factories]
                for extension in self.extensions:
                    await nursery.start(extension.run)
                task_status.started(self)
                await self._shutdown.wait()
                log.info("shutting down")
                with trio.move_on_after(1.0):
                    for extension in self.extensions:
                        on_shutdown = getattr(extension, "on_shutdown", None)
                        if on_shutdown is not None:
                            await on_shutdown()
                with trio.move_on_after(_GOODBYE_BUDGET_S):
                    await self._say_goodbye()
                log.info("goodbyes said; stopping the services")
                nursery.cancel_scope.cancel()
            log.info("services stopped; closing the host")
        log.info("host closed")

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

    # -- addresses -------------------------------------------------------------------------

    def dialable_addrs(self) -> list[str]:
        assert self.host is not None
        if self.config.announce:
            return [f"{a.split('/p2p/')[0]}/p2p/{self.peer_id}" for a in self.config.announce]
        return dialable_addrs(self.host.get_transport_addrs(), self.peer_id.to_base58())

    # -- bootstrap and reconnection ----------------------------------------------------------

    async def _bootstrap(self) -> None:
        """Reach at least one bootstrap peer within the timeout, retrying with backoff."""
        if not self.config.peers:
            return
        for peer in self.config.peers:
            try:
                info = peer_info_from_addr(peer)
            except ValueError as exc:
                raise ConfigError(f"--peer: {exc}") from None
            self.peer_book.learn(info.peer_id.to_base58(), [peer], now=time.time(), bootstrap=True)
        errors: dict[str, str] = {}
        outcome = JoinOutcome()
        with trio.move_on_after(self.config.bootstrap_timeout_s):
            delay = 0.5
            while True:
                async with trio.open_nursery() as nursery:
                    for peer in self.config.peers:
                        nursery.start_soon(self._try_dial_addr, peer, errors)
                if self._connected_ids():
                    outcome = await self._bootstrap_outcome()
                    # a run with a secret is joined only through a member that proved it
                    if outcome.members or self.access.access.secret is None:
                        self.joined = outcome
                        return
                await trio.sleep(delay)
                delay = min(delay * 2, self.config.max_backoff_s)
        if outcome.refused:
            reasons = "; ".join(f"{peer}: {why}" for peer, why in outcome.refused.items())
            raise ConfigError(
                f"no bootstrap peer proved to be a member of run {self.config.run_id!r} within "
                f"{self.config.bootstrap_timeout_s:g} s ({reasons})"
            )
        reasons = "; ".join(f"{addr}: {why}" for addr, why in errors.items()) or "timed out"
        raise ConfigError(
            f"could not reach any bootstrap peer within {self.config.bootstrap_timeout_s:g} s ({reasons})"
        )

    async def _bootstrap_outcome(self) -> JoinOutcome:
        """Which connected bootstrap peers are members of the run, by what their identify
        says (a Lattica protocol) and, with a secret or allowlist, the access check."""
        host = self.running_host
        ids = [r.peer_id for r in self.peer_book.records() if r.bootstrap and r.peer_id in self._connected_ids()]
        with trio.move_on_after(_IDENTIFY_WAIT_S):  # identify runs right after connecting
            while not all(_identified(host, peer_id) for peer_id in ids):
                await trio.sleep(0.05)
        members: list[str] = []
        refused: dict[str, str] = {}
        for peer_id in ids:
            if not _speaks_lattica(host, peer_id):
                refused[peer_id] = "speaks no Lattica protocol (a plain libp2p node)"
                continue
            conns = host.get_network().connections.get(ID.from_base58(peer_id)) or []
            if conns and await self.access.admit(peer_id, conns[0].muxed_conn):
                members.append(peer_id)
            else:
                refused[peer_id] = "did not prove membership of the run (secret or allowlist)"
        return JoinOutcome(members=tuple(members), refused=refused)

    def join_summary(self) -> str:
        """One line on what start-up joined, for the user."""
        return self.joined.summary(self.config.run_id)

    async def _try_dial_addr(self, addr: str, errors: dict[str, str]) -> bool:
        info = peer_info_from_addr(addr)
        try:
            await self._dial(info)
        except Exception as exc:  # noqa: BLE001 - any dial failure is reported the same way
            reason = _short_reason(exc)
            if errors.get(addr) != reason:  # each new cause once, not every retry
                log.info("cannot reach bootstrap peer %s: %s", addr, reason)
            errors[addr] = reason
            self.bootstrap_errors[addr] = reason
            return False
        errors.pop(addr, None)
        self.bootstrap_errors.pop(addr, None)
        return True

    async def _dial(self, info: PeerInfo) -> None:
        assert self.host is not None
        key = info.peer_id.to_base58()
        relayed = any("/p2p-circuit" in str(a) for a in info.addrs)
        inflight = self._dialing.get(key)
        # one dial per peer, except that relay addresses heard while a direct-only dial waits
        # on a silent NAT (seconds) get their own dial at once
        if inflight is not None and (inflight or not relayed):
            return
        self._dialing[key] = relayed
        # our own backoff decides when to redial; py-libp2p's negative dial cache would
        # otherwise refuse a peer that came back on the same address
        unblock = getattr(self.host.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(info.peer_id)
        try:
            if self.dialer is not None:
                with trio.fail_after(_PATH_DIAL_TIMEOUT_S):
                    await self.dialer.connect(info.peer_id, info.addrs)
            elif relayed:  # a relay address before the NAT services run (a --peer)
                await self._dial_without_dialer(info)
            else:
                with trio.fail_after(_DIAL_TIMEOUT_S):
                    await self.host.connect(info)
        finally:
            if self._dialing.get(key) == relayed:
                del self._dialing[key]

    async def _dial_without_dialer(self, info: PeerInfo) -> None:
        """Direct addresses first, then each relay address in turn (``host.connect`` refuses
        ``/p2p-circuit``)."""
        assert self.host is not None
        direct = [a for a in info.addrs if "/p2p-circuit" not in str(a)]
        failure: Exception | None = None
        if direct:
            try:
                with trio.fail_after(_DIAL_TIMEOUT_S):
                    await self.host.connect(PeerInfo(info.peer_id, direct))
                return
            except Exception as exc:  # noqa: BLE001 - the relay addresses may still work
                failure = exc
        for addr in info.addrs:
            if "/p2p-circuit" not in str(addr):
                continue
            try:
                with trio.fail_after(_DIAL_TIMEOUT_S * 2):
                    await dial_circuit(self.host, addr)
                return
            except Exception as exc:  # noqa: BLE001 - try the next relay
                failure = exc
        raise failure if failure is not None else LocalProtocolError("no address to dial")

    async def _keep_connected(self, addr: str) -> None:
        """Redial a bootstrap peer whenever it is not connected, backing off exponentially."""
        info = peer_info_from_addr(addr)
        key = info.peer_id.to_base58()
        delay = 1.0
        while True:
            if key in self._connected_ids():
                delay = 1.0
                await trio.sleep(1.0)
                continue
            record = self.peer_book.get(key)
            errors: dict[str, str] = {}
            if (record is None or not record.left) and await self._try_dial_addr(addr, errors):
                if key in self._connected_ids():
                    log.info("reconnected to bootstrap peer %s", key)
                    delay = 1.0
                    continue
                # the dial "succeeded" but the connection is already gone (py-libp2p can
                # return from connect() on a stale entry): back off like any failure
            await trio.sleep(delay)
            delay = min(delay * 2, self.config.max_backoff_s)

    # -- connection watching and peer exchange ----------------------------------------------

    def _connected_ids(self) -> set[str]:
        assert self.host is not None
        return {p.to_base58() for p in self.host.get_connected_peers()}

    async def _watch_connections(self) -> None:
        assert self.host is not None
        while True:
            joined, gone = self.peer_book.set_connected(self._connected_ids(), now=time.time())
            for peer_id in joined:
                addrs = self._peerstore_addrs(peer_id)
                self.peer_book.learn(peer_id, addrs, now=time.time())
                record = self.peer_book.get(peer_id)
                if record is not None and record.path == "unknown" and self.dialer is None:
                    record.path = "direct"  # relayed connections exist only with the NAT services
                log.info("peer connected: %s", peer_id)
            for peer_id in gone:
                self._no_px.discard(peer_id)  # it may come back as a newer version
                log.info("peer disconnected: %s", peer_id)
            self.metrics.set_peers(r.path for r in self.peer_book.records() if r.connected)
            await trio.sleep(_WATCH_INTERVAL_S)

    def _known_addrs(self, peer_id: str) -> list[str]:
        """Addresses to tell others for ``peer_id``; refreshed from identify as it arrives."""
        fresh = self._peerstore_addrs(peer_id)
        record = self.peer_book.learn(peer_id, fresh, now=time.time())
        return list(record.addrs) if record is not None else fresh

    def _peerstore_addrs(self, peer_id: str) -> list[str]:
        assert self.host is not None
        try:
            addrs = self.host.get_peerstore().addrs(ID.from_base58(peer_id))
        except Exception:  # noqa: BLE001 - an unknown peer simply has no addresses yet
            return []
        out = []
        for a in addrs:
            text = str(a)
            if "/p2p-circuit" in text:  # identify's relay addresses (no trailing id)
                circuit = circuit_addr_for(text, peer_id)
                if circuit is not None:
                    out.append(circuit)
            elif "/tcp/" in text:
                out.append(text if "/p2p/" in text else f"{text}/p2p/{peer_id}")
        return out

    async def _peer_exchange_loop(self) -> None:
        # dials of newly heard peers run beside the exchanges: a relayed dial takes seconds
        async with trio.open_nursery() as dials:
            while True:
                async with trio.open_nursery() as nursery:
                    for peer_id in self.peer_book.connected_ids():
                        if self._may_exchange_with(peer_id):
                            nursery.start_soon(self._exchange_with, peer_id, dials)
                await trio.sleep(_PX_INTERVAL_S)

    def _may_exchange_with(self, peer_id: str) -> bool:
        """Not with a peer that refused it, nor one whose identify lacks it (a plain libp2p
        relay or DHT server): no stream opened every two seconds for nothing."""
        if peer_id in self._no_px:
            return False
        return peer_may_support(self.running_host, ID.from_base58(peer_id), PX_PROTOCOL)

    async def _exchange_with(self, peer_id: str, dials: trio.Nursery) -> None:
        assert self.host is not None
        try:
            with trio.fail_after(_STREAM_TIMEOUT_S):
                started = time.perf_counter()
                stream = MeteredStream(
                    await self.host.new_stream(ID.from_base58(peer_id), [PX_PROTOCOL]),
                    self.metrics,
                    str(PX_PROTOCOL),
                )
                try:
                    await write_message(stream, {"run": self.config.run_id}, peer_id=peer_id)
                    reply = await read_message(stream, max_size=MAX_REPLY_BYTES, peer_id=peer_id)
                finally:
                    await stream.close()
                rtt_ms = (time.perf_counter() - started) * 1000
            entries = parse_px_reply(reply, peer_id=peer_id)
        except LatticaError as exc:
            log.warning("peer exchange with %s failed: %s", peer_id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - network failures of any kind end this exchange
            if "not supported" in str(exc):
                self._no_px.add(peer_id)
            log.debug("peer exchange with %s failed: %r", peer_id, exc)
            return
        record = self.peer_book.get(peer_id)
        if record is not None:
            record.rtt_ms = round(rtt_ms, 2)
        connected = self._connected_ids()
        for other, addrs in entries:
            rec = self.peer_book.learn(other, addrs, now=time.time())
            if rec is None or other in connected or rec.left or not addrs or self._dialing.get(other):
                continue
            dials.start_soon(self._dial_any, other, list(rec.addrs))

    async def _dial_any(self, peer_id: str, addrs: list[str]) -> bool:
        maddrs = dial_addrs_for(peer_id, addrs, relayed=self.dialer is not None)
        if not maddrs:
            return False
        try:
            await self._dial(PeerInfo(ID.from_base58(peer_id), maddrs))
        except Exception as exc:  # noqa: BLE001 - unreachable addresses are common and harmless
            log.debug("could not dial %s: %s", peer_id, _short_reason(exc))
            return False
        return peer_id in self._connected_ids()

    async def dial_peer(self, peer_id: str, addrs: Sequence[str] = ()) -> bool:
        """Connect to ``peer_id`` at ``addrs`` plus every address known for it (direct and
        relayed); True when connected afterwards. For run members found in the DHT or the
        replicated state."""
        if peer_id == self.peer_id.to_base58():
            return False
        if peer_id in self._connected_ids():
            return True
        record = self.peer_book.learn(peer_id, list(addrs), now=time.time())
        if record is None or record.left:
            return False
        return await self._dial_any(peer_id, list(record.addrs))

    async def _handle_px(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id.to_base58()
        stream = MeteredStream(stream, self.metrics, str(PX_PROTOCOL))  # type: ignore[assignment]
        try:
            with trio.fail_after(_STREAM_TIMEOUT_S):
                request = await read_message(stream, max_size=1024, peer_id=peer_id)
                same_run = isinstance(request, dict) and request.get("run") == self.config.run_id
                entries = []
                if same_run:
                    entries = [
                        (pid, self._known_addrs(pid))
                        for pid in self.peer_book.connected_ids()
                        if pid != peer_id
                    ]
                await write_message(stream, px_reply(entries), peer_id=peer_id)
        except Exception as exc:  # noqa: BLE001 - a bad request only ends this stream
            log.debug("peer-exchange request from %s failed: %r", peer_id, exc)
        finally:
            await stream.close()

    async def _handle_bye(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(_STREAM_TIMEOUT_S):
                await read_message(stream, max_size=1024, peer_id=peer_id)
                self.peer_book.mark_left(peer_id, now=time.time())
                log.info("peer %s is leaving", peer_id)
                await write_message(stream, {"ok": True}, peer_id=peer_id)
        except Exception as exc:  # noqa: BLE001 - best effort: a goodbye on a stream that may be gone
            log.debug("goodbye from %s failed: %r", peer_id, exc)
        finally:
            await stream.close()

    async def _say_goodbye(self) -> None:
        host = self.running_host

        async def bye(peer_id: str) -> None:
            try:
                stream = await host.new_stream(ID.from_base58(peer_id), [BYE_PROTOCOL])
                await write_message(stream, {"run": self.config.run_id}, peer_id=peer_id)
                await read_message(stream, max_size=1024, peer_id=peer_id)  # the ack
                await stream.close()
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("goodbye to %s failed: %r", peer_id, exc)

        async with trio.open_nursery() as nursery:
            for peer_id in sorted(self._connected_ids()):
                nursery.start_soon(bye, peer_id)

    # -- control API ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        connected = self.peer_book.connected_ids()
        status: dict[str, Any] = {
            "peer_id": self.peer_id.to_base58(),
            "version": __version__,
            "run_id": self.config.run_id,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "addrs": self.dialable_addrs(),
            "connected_peers": len(connected),
            "known_peers": len(self.peer_book.records()),
            "joined": self.join_summary() if self.config.peers else "started a new swarm",
            "metrics_addr": self.metrics_addr,
            "access": self.access.status(),
        }
        for extension in self.extensions:
            contribute = getattr(extension, "status", None)
            if contribute is not None:
                status.update(contribute())
        return status

    async def _handle_control(self, request: ControlRequest) -> Any:
        if request.method == "status":
            return self.status()
        if request.method == "id":
            return {"peer_id": self.peer_id.to_base58(), "addrs": self.dialable_addrs()}
        if request.method == "peers":
            for extension in self.extensions:  # paths and RTTs as the connections are now
                refresh = getattr(extension, "refresh_peer_table", None)
                if refresh is not None:
                    refresh()
            return [r.as_json() for r in self.peer_book.records()]
        if request.method == "shutdown":
            self.request_shutdown()
            return {"stopping": True}
        if request.method == "doctor":  # served here: it must answer while bootstrap still runs
            from lattica.observability.doctor import node_facts

            return await node_facts(self)
        for extension in self.extensions:
            handle = getattr(extension, "handle_control", None)
            if handle is not None:
                result = await handle(request)
                if result is not None:
                    return result
        raise LocalProtocolError(f"this daemon does not serve {request.method!r}")


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


def dial_addrs_for(peer_id: str, addrs: Sequence[str], *, relayed: bool) -> list[multiaddr.Multiaddr]:
    """The addresses worth dialing for ``peer_id``, as heard from peers (untrusted).

    Direct addresses lose their ``/p2p/<id>`` suffix (the handshake proves the id); relay
    addresses are kept whole and only when they end in ``peer_id`` (or in ``/p2p-circuit``, as
    identify and DHT records carry them; ``peer_id`` is then appended) — one naming another
    peer would connect us to someone else. Unparsable addresses are skipped.
    """
    out: list[multiaddr.Multiaddr] = []
    for text in addrs:
        is_relay = "/p2p-circuit" in text
        if is_relay:  # identify and DHT records carry them without the trailing id
            text = circuit_addr_for(text, peer_id) or ""
        if is_relay and (not relayed or not text):
            continue
        if not is_relay:
            base, _, named = text.partition("/p2p/")
            if named and named != peer_id:
                continue
            text = base
        try:
            out.append(multiaddr.Multiaddr(text))
        except Exception:  # noqa: BLE001 - a malformed address from a peer is just skipped
            continue
    return out


def _short_reason(exc: BaseException) -> str:
    """The cause of a failed dial, in one line: py-libp2p wraps it (``unable to connect …
    (with exceptions)``) with the real reasons a level or two down."""
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    reasons = list(dict.fromkeys(_root_reasons(exc)))
    text = "; ".join(reasons)[:300]
    if "negotiate the secure protocol" in text:
        text += " (the peer offers no Noise; Lattica speaks TCP + Noise + Yamux)"
    elif "negotiate the multiplexer" in text:
        text += " (the peer offers no Yamux; Lattica speaks TCP + Noise + Yamux)"
    return text


def _root_reasons(exc: BaseException, depth: int = 0) -> list[str]:
    """One line per failure inside ``exc``'s exception groups (``errors`` or ``exceptions``),
    looking through a ``__cause__`` that holds them."""
    for holder in (exc, exc.__cause__):
        subs = getattr(holder, "errors", None) or getattr(holder, "exceptions", None)
        if isinstance(subs, list | tuple) and subs and depth < 4:
            return [r for sub in subs if isinstance(sub, BaseException) for r in _root_reasons(sub, depth + 1)]
    if isinstance(exc, trio.TooSlowError):
        return ["timed out"]
    text = _first_line(exc)
    deepest: str | None = None
    inner: BaseException = exc
    for _ in range(6):  # down to the OS error under "fail to open connection to peer …"
        subs = getattr(inner, "exceptions", None)
        below = inner.__cause__ if inner.__cause__ is not None else (subs[0] if subs else None)
        if below is None:
            break
        inner = below
        if not isinstance(inner, BaseExceptionGroup) and _first_line(inner) not in text:
            deepest = _first_line(inner)
    if deepest is not None:
        text = f"{text}: {deepest}"
    return [text[:300]]


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0][:200]


@dataclass(frozen=True)
class JoinOutcome:
    """The bootstrap peers that are members of the run, and why the others are not."""

    members: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)

    def summary(self, run_id: str) -> str:
        others = len(self.refused)
        if self.members:
            text = f"joined run {run_id!r} through {len(self.members)} member(s)"
            return text + (f"; {others} bootstrap peer(s) are not members" if others else "")
        if others:
            return (f"connected to {others} bootstrap peer(s) that speak no Lattica protocol (a plain "
                    f"libp2p relay or DHT node); run {run_id!r} members are found through the DHT")
        return f"joined run {run_id!r}"


def _identified(host: IHost, peer_id: str) -> bool:
    try:
        return bool(host.get_peerstore().get_protocols(ID.from_base58(peer_id)))
    except Exception:  # noqa: BLE001 - not in the peerstore yet
        return False


def _speaks_lattica(host: IHost, peer_id: str) -> bool:
    try:
        protocols = host.get_peerstore().get_protocols(ID.from_base58(peer_id))
    except Exception:  # noqa: BLE001 - not in the peerstore yet
        return False
    return any(str(p).startswith("/lattica/") for p in protocols)
