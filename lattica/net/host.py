"""Building the libp2p host: TCP transport, Noise security, Yamux multiplexing — nothing else.

py-libp2p's default ``new_host`` offers Noise, TLS, secio *and plaintext*; we always pass the
security and muxer options explicitly so that no unencrypted or deprecated channel is ever
negotiated, whatever the remote side proposes.

What the host tells other peers (identify) follows what it does:

- ``LatticaHost`` advertises, besides its direct addresses, the ``/p2p-circuit`` addresses of
  its relay reservations (``set_circuit_addrs``). They reach any libp2p peer the standard way:
  identify's listen addresses, the signed peer record, and the provider records the DHT
  stores — so a NAT'd node can be found through a DHT server that knows nothing of Lattica.
  (py-libp2p's own ``get_addrs`` cuts a circuit address at its first ``/p2p/``, turning the
  relay's address into a false direct address of ours; circuits are appended after it.)
- ``LatticaHost`` takes an optional ``StreamGuard`` (the run's access gate): every stream
  handler registered after construction, and every stream opened, goes through it, so a
  members-only run serves and sends nothing to non-members whoever registers the protocol
  (our services or py-libp2p's Kademlia). Handlers the host registers while it is built
  (identify, ping) stay open.
- ``AnnouncementWatcher`` pushes identify (``/ipfs/id/push/1.0.0``, ``identify_push.py``) to every connected peer
  whenever the protocols we serve or the addresses we advertise change. Services register
  their handlers after the bootstrap peers identified us (``/ipfs/kad/1.0.0`` among them); a
  standard DHT server adds a peer to its routing table only once identify says it serves
  Kademlia, and a peer only learns of a new relay address this way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import multiaddr
import trio
from libp2p import new_swarm
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as _new_x25519
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from trio_typing import TaskStatus

from lattica.net.identify_push import push_identify
from lattica.net.libp2p_compat import auto_connector

log = logging.getLogger(__name__)

SECURITY_PROTOCOLS = (str(NOISE_PROTOCOL_ID),)
MUXER_PROTOCOLS = (YAMUX_PROTOCOL_ID,)
MAX_CIRCUIT_ADDRS = 8


class StreamGuard(Protocol):
    """Decides which streams a host serves and keeps (``lattica.net.access.AccessGate``)."""

    def guard_handler(self, protocol_id: TProtocol, handler: StreamHandlerFn) -> StreamHandlerFn: ...

    async def check_opened(self, stream: INetStream, protocol_ids: Sequence[TProtocol]) -> None: ...


class LatticaHost(BasicHost):
    """A ``BasicHost`` that also advertises its relay (``/p2p-circuit``) addresses and puts
    its streams through an optional ``StreamGuard``."""

    def __init__(self, *args: object, guard: StreamGuard | None = None, **kwargs: object) -> None:
        # set before BasicHost.__init__, which signs a peer record from get_addrs()
        self._circuit_addrs: tuple[multiaddr.Multiaddr, ...] = ()
        self._guard: StreamGuard | None = None  # identify and ping, registered next, stay open
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._guard = guard

    def set_stream_handler(self, protocol_id: TProtocol, stream_handler: StreamHandlerFn) -> None:
        if self._guard is not None:
            stream_handler = self._guard.guard_handler(protocol_id, stream_handler)
        super().set_stream_handler(protocol_id, stream_handler)

    async def new_stream(self, peer_id: ID, protocol_ids: Sequence[TProtocol]) -> INetStream:
        stream = await super().new_stream(peer_id, protocol_ids)
        if self._guard is not None:
            await self._guard.check_opened(stream, protocol_ids)
        return stream

    def set_circuit_addrs(self, addrs: Sequence[multiaddr.Multiaddr | str]) -> bool:
        """Advertise these relay addresses (ours: each ends in ``/p2p-circuit/p2p/<our id>``,
        or in ``/p2p-circuit``); True when the set changed."""
        me = self.get_id().to_base58()
        wanted: list[multiaddr.Multiaddr] = []
        for addr in addrs:
            text = circuit_addr_for(str(addr), me)
            if text is not None and all(str(w) != text for w in wanted):
                wanted.append(multiaddr.Multiaddr(text))
        new = tuple(wanted[:MAX_CIRCUIT_ADDRS])
        if [str(a) for a in new] == [str(a) for a in self._circuit_addrs]:
            return False
        self._circuit_addrs = new
        return True

    def circuit_addrs(self) -> list[multiaddr.Multiaddr]:
        return list(self._circuit_addrs)

    def get_addrs(self) -> list[multiaddr.Multiaddr]:
        return [*super().get_addrs(), *self._circuit_addrs]


def circuit_addr_for(text: str, peer_id: str) -> str | None:
    """``text`` as a circuit address ending in ``/p2p-circuit/p2p/<peer_id>``, or None when
    it is no circuit address or names another peer after the circuit."""
    head, sep, tail = text.partition("/p2p-circuit")
    if not sep or "/p2p/" not in head:
        return None
    if tail in ("", "/"):
        return f"{head}/p2p-circuit/p2p/{peer_id}"
    return text if tail == f"/p2p/{peer_id}" else None


def build_host(
    key_pair: KeyPair,
    *,
    listen_addrs: Sequence[multiaddr.Multiaddr] = (),
    announce_addrs: Sequence[multiaddr.Multiaddr] = (),
    guard: StreamGuard | None = None,
) -> LatticaHost:
    """A libp2p host that speaks TCP + Noise + Yamux only; ``guard`` sees every stream."""
    from libp2p.rcmgr import new_resource_manager

    noise = NoiseTransport(libp2p_keypair=key_pair, noise_privkey=_new_x25519().private_key)
    resources = new_resource_manager()
    swarm = new_swarm(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=list(listen_addrs) or None,
        connection_config=connection_config(),
        resource_manager=resources,
    )
    return LatticaHost(
        network=swarm,
        resource_manager=resources,
        announce_addrs=list(announce_addrs) or None,
        guard=guard,
    )


def connection_config() -> ConnectionConfig:
    """Watermarks for py-libp2p's connection manager: pruning caps the total at 256."""
    return ConnectionConfig(min_connections=0, low_watermark=0, high_watermark=256)


async def stop_auto_connector(host: IHost) -> None:
    """Stop py-libp2p's auto-connector once the host runs.

    It dials every peer the peerstore has heard of until it holds half the high watermark of
    connections, and the DHT fills the peerstore: in a large run every node would dial every
    node. Lattica decides whom to connect to itself (bootstrap peers, peer exchange, the run's
    members from the DHT).
    """
    connector = auto_connector(host)
    if connector is not None:
        await connector.stop()


def announcement(host: IHost) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What identify tells peers about us: (protocols served, addresses advertised)."""
    protocols = tuple(sorted(str(p) for p in host.get_mux().get_protocols() if p is not None))
    return protocols, tuple(str(a) for a in host.get_addrs())


class AnnouncementWatcher:
    """Pushes identify to connected peers whenever ``announcement(host)`` changes.

    Polled (``interval``) rather than hooked: handlers are registered by many services, and
    a burst of registrations then costs one push.
    """

    def __init__(self, host: IHost, *, interval: float = 0.5, push_timeout: float = 5.0) -> None:
        if interval <= 0 or push_timeout <= 0:
            raise ValueError("interval and push_timeout must be positive")
        self._host = host
        self._interval = interval
        self._push_timeout = push_timeout
        self.pushes = 0

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        announced = announcement(self._host)
        task_status.started()
        while True:
            await trio.sleep(self._interval)
            current = announcement(self._host)
            if current == announced:
                continue
            announced = current
            await self.push()

    async def push(self) -> None:
        """Identify push to every connected peer; best effort, bounded in time."""
        self.pushes += 1
        try:
            with trio.move_on_after(self._push_timeout):
                await push_identify(self._host)
        except Exception as exc:  # noqa: BLE001 - a peer that breaks the push is not our problem
            log.debug("identify push failed: %r", exc)


def peer_may_support(host: IHost, peer_id: ID, protocol: str) -> bool:
    """False only when the peer's identify listed its protocols and ``protocol`` is not
    among them (a plain libp2p node, or a service it has not started): no stream is worth
    opening then. Before identify has answered, True (try). Identify push keeps it current.
    """
    try:
        protocols = host.get_peerstore().get_protocols(peer_id)
    except Exception:  # noqa: BLE001 - a peer the peerstore does not know yet
        return True
    return not protocols or str(protocol) in {str(p) for p in protocols}
