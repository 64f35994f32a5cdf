"""Circuit relay v2: serving relays with limits, and keeping reservations on relays.

Theory of operation.

*Serving* (``RelayServer``): every node answers the STOP protocol (that is how relayed
connections reach it). A node also answers HOP (RESERVE / CONNECT) when it serves as a relay:
always when ``serve=True``, or only while its ``ReachabilityService`` says PUBLIC when
``serve="auto"``. Limits per reservation: ``max_reservations`` slots, ``reservation_ttl``,
``max_circuit_conns`` concurrent circuits per reserving peer, and per circuit a byte budget
(``data``, both directions together) and a ``duration``; a circuit over either is reset. The
wire protocol is py-libp2p's ``CircuitV2Protocol``, which refuses HOP over relayed connections
and caps messages at 64 KiB.

*Reserving* (``RelayReservations``): a private node keeps ``want`` reservations on distinct
relays. Candidates are the configured relays plus connected peers that advertise HOP. A
reservation is dropped when its relay disconnects or it expires; it is refreshed
``refresh_margin`` seconds before expiry; missing slots are filled from other candidates, with
a per-relay backoff after failures. ``relay_addrs()`` lists the ``/p2p-circuit`` addresses to
advertise (DHT, replicated state); ``wait_change()`` wakes up when that list changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import trio
from libp2p.abc import IHost, INetConn
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError
from trio_typing import TaskStatus

from lattica.net.identify_push import push_identify
from lattica.net.libp2p_compat import hop_stream_handler
from lattica.net.nat.addresses import conn_is_relayed, is_circuit
from lattica.net.nat.autonat import Reachability, ReachabilityService

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RelayLimitsConfig:
    max_reservations: int = 128
    reservation_ttl: int = 3600
    max_circuit_conns: int = 16
    duration: int = 3600  # seconds per circuit
    data: int = 1 << 30  # bytes per circuit, both directions together

    def __post_init__(self) -> None:
        for name in ("max_reservations", "reservation_ttl", "max_circuit_conns", "duration",
                     "data"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def to_library(self) -> RelayLimits:
        return RelayLimits(duration=self.duration, data=self.data,
                           max_circuit_conns=self.max_circuit_conns,
                           max_reservations=self.max_reservations,
                           reservation_ttl=self.reservation_ttl)


class RelayServer:
    def __init__(self, host: IHost, *, limits: RelayLimitsConfig | None = None,
                 serve: bool | Literal["auto"] = "auto",
                 reachability: ReachabilityService | None = None) -> None:
        if serve == "auto" and reachability is None:
            raise ValueError('serve="auto" needs a ReachabilityService')
        self._host = host
        self._serve = serve
        self._reachability = reachability
        self.protocol = CircuitV2Protocol(host, limits=(limits or RelayLimitsConfig()).to_library(),
                                          allow_hop=False)
        self.serving = False

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            try:
                if self._serve is True:
                    self._set_serving(True)
                task_status.started()
                if self._serve == "auto":
                    assert self._reachability is not None
                    while True:
                        if self._set_serving(self._reachability.reachability is Reachability.PUBLIC):
                            await self._tell_peers()
                        await self._reachability.wait_change()
                await trio.sleep_forever()
            finally:
                self._set_serving(False)

    async def _tell_peers(self) -> None:
        """Identify push: connected peers learn at once that we (no longer) serve HOP, so a
        private one can reserve here without reconnecting."""
        try:
            with trio.move_on_after(5.0):
                await push_identify(self._host)
        except Exception as exc:  # noqa: BLE001 - best effort: identify push raises many kinds on peers that left
            logger.debug("identify push after relay change failed: %r", exc)

    def _set_serving(self, on: bool) -> bool:
        if on == self.serving:
            return False
        if on:
            self._host.set_stream_handler(HOP_PROTOCOL_ID, hop_stream_handler(self.protocol))
        else:
            self._host.remove_stream_handler(HOP_PROTOCOL_ID)
        self.serving = on
        logger.info("relay service %s", "on" if on else "off")
        return True


@dataclass(frozen=True)
class RelayReservation:
    relay_id: ID
    expires_at: float
    relay_addrs: tuple[Multiaddr, ...]


class ReservationRefused(Exception):
    pass


class RelayReservations:
    def __init__(self, host: IHost, *, relays: Sequence[PeerInfo] = (), want: int = 2,
                 refresh_margin: float = 60.0, backoff: float = 5.0,
                 poll_interval: float = 0.25, reserve_timeout: float = 5.0) -> None:
        if want < 1:
            raise ValueError("want must be >= 1")
        self._host = host
        self._static = list(relays)
        self._want = want
        self._refresh_margin = refresh_margin
        self._backoff = backoff
        self._poll = poll_interval
        self._timeout = reserve_timeout
        self.reservations: dict[ID, RelayReservation] = {}
        self._failed_until: dict[ID, float] = {}
        self._changed = trio.Event()

    def relay_addrs(self) -> list[Multiaddr]:
        me = self._host.get_id().to_base58()
        return [
            Multiaddr(f"{addr}/p2p-circuit/p2p/{me}")
            for res in self.reservations.values()
            for addr in res.relay_addrs
        ]

    async def wait_change(self) -> list[Multiaddr]:
        await self._changed.wait()
        return self.relay_addrs()

    def add_relay(self, info: PeerInfo) -> None:
        if all(r.peer_id != info.peer_id for r in self._static):
            self._static.append(info)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.maintain()
            await trio.sleep(self._poll)

    async def maintain(self) -> None:
        changed = self._drop_lost()
        now = time.time()
        for relay_id, res in list(self.reservations.items()):
            if res.expires_at - now <= self._refresh_margin:
                changed |= await self._try_reserve(relay_id)
        for info in self._candidates():
            if len(self.reservations) >= self._want:
                break
            changed |= await self._try_reserve(info.peer_id, info)
        if changed:
            self._changed.set()
            self._changed = trio.Event()

    def _drop_lost(self) -> bool:
        connections = self._host.get_network().connections
        now = time.time()
        lost = [
            rid for rid, res in self.reservations.items()
            if res.expires_at <= now or not any(
                conn_is_relayed(c) is False for c in _as_list(connections.get(rid))
            )
        ]
        for rid in lost:
            logger.info("lost reservation on relay %s", rid)
            del self.reservations[rid]
            self._failed_until[rid] = now + self._backoff
        return bool(lost)

    def _candidates(self) -> list[PeerInfo]:
        seen = set(self.reservations)
        now = time.time()
        result = []
        peerstore = self._host.get_peerstore()
        discovered = []
        for peer_id in list(self._host.get_network().connections):
            try:
                if HOP_PROTOCOL_ID in peerstore.get_protocols(peer_id):
                    discovered.append(peerstore.peer_info(peer_id))
            except PeerStoreError:
                continue
        for info in [*self._static, *discovered]:
            if info.peer_id in seen or self._failed_until.get(info.peer_id, 0) > now:
                continue
            seen.add(info.peer_id)
            result.append(info)
        return result

    async def _try_reserve(self, relay_id: ID, info: PeerInfo | None = None) -> bool:
        try:
            with trio.fail_after(self._timeout):
                if info is not None:
                    await self._host.connect(info)
                res = await self._reserve(relay_id)
        except Exception as exc:  # noqa: BLE001 - network: any failure to connect or reserve is a failed reservation, retried
            logger.info("reservation on relay %s failed: %r", relay_id, exc)
            self.reservations.pop(relay_id, None)
            self._failed_until[relay_id] = time.time() + self._backoff
            return True
        first = relay_id not in self.reservations
        self.reservations[relay_id] = res
        logger.info("reserved on relay %s until %.0f", relay_id, res.expires_at)
        return first

    async def _reserve(self, relay_id: ID) -> RelayReservation:
        stream = await self._host.new_stream(relay_id, [HOP_PROTOCOL_ID])
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
        finally:
            await stream.close()
        status = StatusCode(resp.status) if resp.HasField("status") else None
        if resp.type != HopMessage.STATUS or status != StatusCode.OK:
            raise ReservationRefused(f"relay {relay_id} answered status {status}")
        if not resp.HasField("reservation") or resp.reservation.expire <= time.time():
            raise ReservationRefused(f"relay {relay_id} sent no valid reservation")
        return RelayReservation(relay_id, float(resp.reservation.expire),
                                self._relay_addrs(relay_id, list(resp.reservation.addrs)))

    def _relay_addrs(self, relay_id: ID, raw: list[bytes]) -> tuple[Multiaddr, ...]:
        suffix = f"/p2p/{relay_id.to_base58()}"
        addrs: list[Multiaddr] = []
        for item in raw[:16]:
            try:
                addr = Multiaddr(item)
            except (MultiaddrError, ValueError, TypeError):
                continue
            text = str(addr)
            if is_circuit(text) or not text.endswith(suffix):
                continue
            addrs.append(addr)
        if not addrs:  # fall back to the address we reached the relay at
            for conn in _as_list(self._host.get_network().connections.get(relay_id)):
                for addr in conn.get_transport_addresses() or []:
                    if not is_circuit(addr):
                        addrs.append(Multiaddr(f"{str(addr).split('/p2p/')[0]}{suffix}"))
        return tuple(addrs)


def _as_list(conns: INetConn | list[INetConn] | None) -> list[INetConn]:
    if not conns:
        return []
    return conns if isinstance(conns, list) else [conns]
