"""Whom a node is connected to: bootstrap, redial, peer exchange, goodbyes, and how to dial.

Theory of operation: ``Connectivity.run`` serves peer exchange (``PX_PROTOCOL``) and goodbyes
(``BYE_PROTOCOL``), watches the host's connections into the peer book, dials the bootstrap
peers (``--peer``) until one answers within ``bootstrap_timeout_s`` — with a run secret, until
one proved membership (``lattica.net.bootstrap``) — or, without ``--peer``, gives the members
saved by its previous life a moment to answer. Then its ``Reconnector`` (``lattica.net.reconnect``) keeps the bootstrap
peers and known members connected with backoff, also those that said goodbye, and saves them
in the data dir; and every two seconds it asks connected peers whom they know (peer exchange),
dialing the verified run members among them within ``PxDialBudget``. Start-up fails with
``ConfigError`` (one line for the user) when no bootstrap peer answers — for a relay address,
when the peer behind the relay is not reached (a relay that refuses the circuit is named, with
its status code); after that, losing them only triggers reconnection attempts.

Dialing (one dial per peer at a time): until the NAT traversal runs (start-up, or
``nat = false``) peers are dialed at their direct addresses with ``host.connect``, and a relay
address (a ``--peer``) with ``dial_circuit``. Once ``NatTraversal`` runs — started right after
bootstrap — every dial (bootstrap redials, peer exchange, DHT run members, replicated-state
members through ``dial_peer``) goes through its ``Dialer`` with the peer's direct and relay
addresses, so two peers behind NATs reach each other. Relay addresses are accepted only when
they end in the peer's own id (``dial_addrs_for``).

On the way out, ``say_goodbye`` tells every connected peer we leave, so they mark us as gone
at once instead of redialing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.errors import LatticaError, LocalProtocolError
from lattica.net.access import AccessGate
from lattica.net.addrs import dialable_addrs, peer_info_from_addr
from lattica.net.bootstrap import JoinOutcome, bootstrap_peers, join_through, speaks_lattica
from lattica.net.dialing import dial_addrs_for, short_reason
from lattica.net.host import circuit_addr_for, peer_may_support
from lattica.net.libp2p_compat import unblock_peer
from lattica.net.nat.circuit import dial_circuit
from lattica.net.nat.dialer import Dialer
from lattica.net.nat.traversal import NatTraversal
from lattica.net.peer_exchange import (
    BYE_PROTOCOL,
    MAX_REPLY_BYTES,
    PX_PROTOCOL,
    parse_px_reply,
    px_reply,
)
from lattica.net.peerbook import PeerBook
from lattica.net.px_dials import PxDialBudget, PxDialLimits
from lattica.net.reconnect import Reconnector
from lattica.net.redial import RedialPolicy
from lattica.net.wire import ByteStream, read_message, write_message

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_PX_INTERVAL_S = 2.0
_DIAL_TIMEOUT_S = 5.0
_PATH_DIAL_TIMEOUT_S = 15.0  # direct (3 s) then up to three relays in turn
_STREAM_TIMEOUT_S = 5.0
_REMEMBERED_WAIT_S = 5.0  # without --peer: for one of the members known from before to answer
_LEFT_MAX_PAUSE_S = 120.0  # the slowest redial of a peer that said goodbye

StreamMeter = Callable[[INetStream, str], ByteStream]
"""Wraps a stream so that its bytes are counted under a protocol label."""

VerifiedMembers = Callable[[], Collection[str]]
"""The peers with a verified membership entry in the run's replicated state."""


class PeerMetrics(Protocol):
    """What connectivity reports: the connected peers, by path."""

    def set_peers(self, paths: Iterable[str]) -> None: ...


class Connectivity:
    """The connection management of one node; see the module docstring."""

    def __init__(
        self, host: IHost, config: NodeConfig, *, access: AccessGate, peer_book: PeerBook,
        metrics: PeerMetrics, meter: StreamMeter, nat: bool,
    ) -> None:
        self._host = host
        self.config = config
        self.peer_id = host.get_id()
        self.access = access
        self.peer_book = peer_book
        self._metrics = metrics
        self._meter = meter
        self._use_nat = nat
        self.nat: NatTraversal | None = None  # built and started right after bootstrap
        self._dialer: Dialer | None = None  # the NAT traversal's, once it runs
        self._dialing: dict[str, bool] = {}  # peer -> the dial in flight includes relay addrs
        self._no_px: set[str] = set()  # connected peers that refused peer exchange
        self._members: VerifiedMembers | None = None  # set once the replicated state runs
        self.px_budget = PxDialBudget(PxDialLimits())
        self.joined = JoinOutcome()  # what bootstrap reached
        self.rejoined = 0  # without --peer: members known from before that answered at start
        self.bootstrap_errors: dict[str, str] = {}  # bootstrap address -> why its last dial failed
        self.reconnector = Reconnector(
            peer_book, dialer=self, data_dir=config.data_dir, bootstrap=bootstrap_peers(config.peers),
            policy=RedialPolicy(
                first_pause_s=min(1.0, config.max_backoff_s), max_pause_s=config.max_backoff_s,
                left_max_pause_s=max(_LEFT_MAX_PAUSE_S, config.max_backoff_s),
            ),
        )

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peer exchange and goodbyes, bootstrap, then keep connected; started once
        bootstrap succeeded (raises ``ConfigError`` when it did not)."""
        self._host.set_stream_handler(PX_PROTOCOL, self._handle_px)
        self._host.set_stream_handler(BYE_PROTOCOL, self._handle_bye)
        remembered = self.reconnector.restore()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_connections)
            await self._bootstrap()
            if remembered and not self.config.peers:
                self.rejoined = await self.reconnector.reach_remembered(wait_s=_REMEMBERED_WAIT_S)
            nursery.start_soon(self.reconnector.run)
            if self.config.peer_exchange:
                nursery.start_soon(self._peer_exchange_loop)
            if self._use_nat:
                self.nat = NatTraversal(self._host)
                await nursery.start(self.nat.run)
                self._dialer = self.nat.dialer  # from now on every dial takes the best path
            task_status.started()

    # -- addresses -------------------------------------------------------------------------

    def dialable_addrs(self) -> list[str]:
        """Where others can reach this node: ``--announce`` if given, else the listen addresses."""
        if self.config.announce:
            return [f"{a.split('/p2p/')[0]}/p2p/{self.peer_id}" for a in self.config.announce]
        return dialable_addrs(self._host.get_transport_addrs(), self.peer_id.to_base58())

    def connected_ids(self) -> set[str]:
        return {p.to_base58() for p in self._host.get_connected_peers()}

    def follow_members(self, verified: VerifiedMembers) -> None:
        """From now on, dial peers named in peer exchange only when ``verified`` lists them
        (without it — a node without the replicated state — any peer, within the budget)."""
        self._members = verified

    def join_summary(self) -> str:
        """One line on what start-up joined, for the user."""
        if self.config.peers:
            return self.joined.summary(self.config.run_id)
        if self.rejoined:
            return f"rejoined run {self.config.run_id!r} through {self.rejoined} member(s) known from before"
        return "started a new swarm"

    # -- bootstrap and reconnection ----------------------------------------------------------

    async def _bootstrap(self) -> None:
        """Reach at least one bootstrap peer (``lattica.net.bootstrap``); what it joined."""
        self.joined = await join_through(
            self.config, host=self._host, access=self.access, peer_book=self.peer_book,
            connected=self.connected_ids, dial=self._try_dial_addr,
        )

    async def _try_dial_addr(self, addr: str, errors: dict[str, str]) -> bool:
        info = peer_info_from_addr(addr)
        try:
            await self._dial(info)
        except Exception as exc:  # noqa: BLE001 - any dial failure is reported the same way
            reason = short_reason(exc)
            if errors.get(addr) != reason:  # each new cause once, not every retry
                log.info("cannot reach bootstrap peer %s: %s", addr, reason)
            errors[addr] = reason
            self.bootstrap_errors[addr] = reason
            return False
        errors.pop(addr, None)
        self.bootstrap_errors.pop(addr, None)
        return True

    # -- what the reconnector dials with (``reconnect.KnownPeerDialer``) ---------------------

    def is_dialing(self, peer_id: str) -> bool:
        return peer_id in self._dialing

    async def dial_bootstrap(self, addr: str) -> bool:
        """Dial a ``--peer`` address, recording why it failed; True when connected after.
        A dial can "succeed" with the connection already gone (py-libp2p can return from
        connect() on a stale entry): that counts as a failure."""
        key = peer_info_from_addr(addr).peer_id.to_base58()
        return await self._try_dial_addr(addr, {}) and key in self.connected_ids()

    async def dial_known(self, peer_id: str, addrs: list[str]) -> bool:
        return await self._dial_any(peer_id, addrs)

    # -- dialing ---------------------------------------------------------------------------

    async def dial_peer(self, peer_id: str, addrs: Sequence[str] = ()) -> bool:
        """Connect to ``peer_id`` at ``addrs`` plus every address known for it (direct and
        relayed); True when connected afterwards. For run members found in the DHT or the
        replicated state."""
        if peer_id == self.peer_id.to_base58():
            return False
        if peer_id in self.connected_ids():
            return True
        record = self.peer_book.learn(peer_id, list(addrs), now=time.time())
        if record is None or record.left:
            return False
        return await self._dial_any(peer_id, list(record.addrs))

    async def _dial_any(self, peer_id: str, addrs: list[str]) -> bool:
        maddrs = dial_addrs_for(peer_id, addrs, relayed=self._dialer is not None)
        if not maddrs:
            return False
        try:
            await self._dial(PeerInfo(ID.from_base58(peer_id), maddrs))
        except Exception as exc:  # noqa: BLE001 - unreachable addresses are common and harmless
            log.debug("could not dial %s: %s", peer_id, short_reason(exc))
            return False
        return peer_id in self.connected_ids()

    async def _dial(self, info: PeerInfo) -> None:
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
        unblock_peer(self._host, info.peer_id)
        try:
            if self._dialer is not None:
                with trio.fail_after(_PATH_DIAL_TIMEOUT_S):
                    await self._dialer.connect(info.peer_id, info.addrs)
            elif relayed:  # a relay address before the NAT traversal runs (a --peer)
                await self._dial_without_dialer(info)
            else:
                with trio.fail_after(_DIAL_TIMEOUT_S):
                    await self._host.connect(info)
        finally:
            if self._dialing.get(key) == relayed:
                del self._dialing[key]

    async def _dial_without_dialer(self, info: PeerInfo) -> None:
        """Direct addresses first, then each relay address in turn (``host.connect`` refuses
        ``/p2p-circuit``)."""
        direct = [a for a in info.addrs if "/p2p-circuit" not in str(a)]
        failure: Exception | None = None
        if direct:
            try:
                with trio.fail_after(_DIAL_TIMEOUT_S):
                    await self._host.connect(PeerInfo(info.peer_id, direct))
            except Exception as exc:  # noqa: BLE001 - the relay addresses may still work
                failure = exc
            else:
                return
        for addr in info.addrs:
            if "/p2p-circuit" not in str(addr):
                continue
            try:
                with trio.fail_after(_DIAL_TIMEOUT_S * 2):
                    await dial_circuit(self._host, addr)
            except Exception as exc:  # noqa: BLE001 - try the next relay
                failure = exc
            else:
                return
        raise failure if failure is not None else LocalProtocolError("no address to dial")

    # -- connection watching and peer exchange ----------------------------------------------

    async def _watch_connections(self) -> None:
        while True:
            joined, gone = self.peer_book.set_connected(self.connected_ids(), now=time.time())
            for peer_id in joined:
                addrs = self._peerstore_addrs(peer_id)
                record = self.peer_book.learn_reported(peer_id, addrs, now=time.time())
                if record is not None and record.path == "unknown" and self._dialer is None:
                    record.path = "direct"  # relayed connections exist only with the NAT traversal
                log.info("peer connected: %s", peer_id)
            for peer_id in gone:
                self._no_px.discard(peer_id)  # it may come back as a newer version
                log.info("peer disconnected: %s", peer_id)
            self._note_members()
            self._metrics.set_peers(r.path for r in self.peer_book.records() if r.connected)
            await trio.sleep(_WATCH_INTERVAL_S)

    def _note_members(self) -> None:
        """Connected peers that speak a Lattica protocol are members worth redialing later
        (a plain libp2p relay or DHT node is not)."""
        for record in self.peer_book.records():
            if record.connected and not record.member and speaks_lattica(self._host, record.peer_id):
                record.member = True

    def _known_addrs(self, peer_id: str) -> list[str]:
        """Addresses to tell others for ``peer_id``: those it vouched for itself (refreshed
        from identify as it arrives), never ones we only heard from a third party."""
        record = self.peer_book.learn_reported(peer_id, self._peerstore_addrs(peer_id), now=time.time())
        return list(record.addrs) if record is not None else []

    def _peerstore_addrs(self, peer_id: str) -> list[str]:
        try:
            addrs = self._host.get_peerstore().addrs(ID.from_base58(peer_id))
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
                self.peer_book.forget_unanswered(now=time.time(), heard_ttl=self.px_budget.limits.heard_ttl_s)
                members = set(self._members()) if self._members is not None else None
                async with trio.open_nursery() as nursery:
                    for peer_id in self.peer_book.connected_ids():
                        if self._may_exchange_with(peer_id):
                            nursery.start_soon(self._exchange_with, peer_id, dials, members)
                await trio.sleep(_PX_INTERVAL_S)

    def _may_exchange_with(self, peer_id: str) -> bool:
        """Not with a peer that refused it, nor one whose identify lacks it (a plain libp2p
        relay or DHT server): no stream opened every two seconds for nothing."""
        if peer_id in self._no_px:
            return False
        return peer_may_support(self._host, ID.from_base58(peer_id), PX_PROTOCOL)

    async def _exchange_with(self, peer_id: str, dials: trio.Nursery, members: set[str] | None) -> None:
        try:
            with trio.fail_after(_STREAM_TIMEOUT_S):
                started = time.perf_counter()
                raw = await self._host.new_stream(ID.from_base58(peer_id), [PX_PROTOCOL])
                stream = self._meter(raw, str(PX_PROTOCOL))
                try:
                    await write_message(stream, {"run": self.config.run_id}, peer_id=peer_id)
                    reply = await read_message(stream, max_size=MAX_REPLY_BYTES, peer_id=peer_id)
                finally:
                    await raw.close()
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
        for other, addrs in self.px_budget.plan(peer_id, self._px_candidates(entries, members), now=time.time()):
            dials.start_soon(self._dial_any, other, addrs)

    def _px_candidates(
        self, entries: list[tuple[str, list[str]]], members: set[str] | None,
    ) -> list[tuple[str, list[str]]]:
        """Peers a reply names that are worth a dial: verified members (when the replicated
        state runs) that are neither connected, leaving, nor being dialed; with the
        addresses they vouched for and those the reply adds (heard, unconfirmed)."""
        connected, now = self.connected_ids(), time.time()
        wanted: list[tuple[str, list[str]]] = []
        for other, addrs in entries:
            if members is not None and other not in members:
                continue
            rec = self.peer_book.hear(other, addrs, now=now)
            if rec is None or other in connected or rec.left or other in self._dialing:
                continue
            wanted.append((other, [*rec.addrs, *rec.heard]))
        return wanted

    async def _handle_px(self, raw: INetStream) -> None:
        peer_id = raw.muxed_conn.peer_id.to_base58()
        stream = self._meter(raw, str(PX_PROTOCOL))
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
            await raw.close()

    # -- goodbyes --------------------------------------------------------------------------

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

    async def say_goodbye(self) -> None:
        """Save the peer book and tell every connected peer we leave (best effort; bound it
        with a deadline)."""

        async def bye(peer_id: str) -> None:
            try:
                stream = await self._host.new_stream(ID.from_base58(peer_id), [BYE_PROTOCOL])
                await write_message(stream, {"run": self.config.run_id}, peer_id=peer_id)
                await read_message(stream, max_size=1024, peer_id=peer_id)  # the ack
                await stream.close()
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("goodbye to %s failed: %r", peer_id, exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.reconnector.save)
            for peer_id in sorted(self.connected_ids()):
                nursery.start_soon(bye, peer_id)

