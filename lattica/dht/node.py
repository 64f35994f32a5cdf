"""One node's view of the Kademlia DHT: py-libp2p's ``KadDHT``, hardened and tunable.

What this adds around the library:

- Mode from reachability: server (answers ``/ipfs/kad/1.0.0``) while the node is or may be
  publicly reachable, client behind NAT. ``set_reachability`` flips it at runtime.
- Every inbound frame is screened (``inbound.py``) against strict namespaced validators
  and size caps; a bad frame is counted, logged once per peer, the peer is banned for a
  while, removed from the routing table, the records it stored here are dropped, and it is
  disconnected.
- Provider records expire after ``DHTConfig.provider_ttl`` rather than 48 h.
- What the node stores for other peers is bounded per sender and in total (``quota.py``,
  ``DHTConfig.store``): a request beyond a quota is refused before the library sees it, and
  both stores charge what they hold to one ledger; ``store_stats`` reports it.
- Every query (FIND_NODE walks, GET_PROVIDERS) is bounded by ``DHTConfig.query_timeout`` and
  reaches a peer it is not connected to through ``reach`` — in the daemon the path dialer,
  relay addresses included (``reach.py``).
- Value records carry their own expiry (``records.py``); ``put_record`` remembers what this
  node published so ``republish_records`` can refresh it before it lapses.

The library's own maintenance service (``KadDHT.run``) is not started: its intervals are
fixed at 10 min / 22 h. ``RunDiscovery`` runs the maintenance loop instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht.config import DHTConfig
from lattica.dht.content import ContentRouting, LookupResult
from lattica.dht.inbound import guarded_handler
from lattica.dht.penalties import PenaltyBox
from lattica.dht.provider_store import ExpiringProviderStore
from lattica.dht.quota import Refusal, StoreLedger, StoreStats
from lattica.dht.reach import PeerReacher, Reach, ReachingPeerRouting
from lattica.dht.records import (
    ExpiringRecord,
    ExpiringRecordValidator,
    InvalidRecord,
    build_validator,
    encode_record,
)
from lattica.dht.screen import quota_refusal
from lattica.dht.value_store import BoundedValueStore
from lattica.errors import LocalProtocolError, RemoteProtocolError

logger = logging.getLogger(__name__)
_REFUSAL_LOG_INTERVAL_S = 60.0


class LatticaDHT:
    def __init__(self, host: IHost, *, config: DHTConfig, reach: Reach | None = None) -> None:
        """``reach`` connects to a peer the DHT wants to query (``reach.py``); by default a
        plain dial of its direct addresses."""
        self._host = host
        self._config = config
        self.validator = build_validator(
            max_value_bytes=config.max_value_bytes, max_ttl=config.record_ttl
        )
        mode = DHTMode.SERVER if config.start_as_server else DHTMode.CLIENT
        # strict_validation must be passed here too: KadDHT copies its own flag onto the
        # validator, and the default (False) would let unknown namespaces through.
        self.kad = KadDHT(
            host, mode, validator=self.validator, validator_changed=True, strict_validation=True
        )
        self.ledger = StoreLedger(config.store)
        self.reacher = PeerReacher(host, reach or self.connect)
        self.kad.peer_routing = ReachingPeerRouting(
            host, self.kad.routing_table, reacher=self.reacher, query_timeout=config.query_timeout
        )
        self.providers = ExpiringProviderStore(
            host=host, peer_routing=self.kad.peer_routing, ttl=config.provider_ttl, ledger=self.ledger
        )
        self.kad.provider_store = self.providers
        self.values = BoundedValueStore(host, host.get_id(), ledger=self.ledger)
        self.kad.value_store = self.values
        self._refusals_logged_at = -_REFUSAL_LOG_INTERVAL_S
        self.penalties = PenaltyBox(ban_seconds=config.ban_seconds)
        self.content = ContentRouting(
            host, self.kad, config, on_bad_answer=self.penalize, reacher=self.reacher
        )
        self._published: dict[str, tuple[bytes, int]] = {}
        if mode == DHTMode.SERVER:
            self._serve()

    # -- mode -----------------------------------------------------------------------------
    @property
    def is_server(self) -> bool:
        return self.kad.mode == DHTMode.SERVER

    async def set_reachability(self, public: bool) -> None:
        """Server mode when publicly reachable, client mode behind NAT."""
        wanted = DHTMode.SERVER if public else DHTMode.CLIENT
        if wanted == self.kad.mode:
            return
        await self.kad.switch_mode(wanted)
        if wanted == DHTMode.SERVER:
            self._serve()  # switch_mode installed the unguarded handler; replace it
        logger.info("DHT now in %s mode", wanted.value.lower())

    def _serve(self) -> None:
        async def handler(stream: INetStream) -> None:
            await guarded_handler(
                stream,
                inner=self.kad.handle_stream,
                validator=self.validator,
                max_frame=self._config.max_message_bytes,
                is_banned=lambda peer: self.penalties.is_banned(peer, now=time.monotonic()),
                on_reject=self.penalize,
                check_store=self._store_refusal,
                on_refuse=self._note_refusal,
            )

        self._host.set_stream_handler(PROTOCOL_ID, handler)

    # -- bad input --------------------------------------------------------------------------
    @property
    def rejected_inputs(self) -> int:
        return self.penalties.rejected_inputs

    async def penalize(self, error: RemoteProtocolError) -> None:
        """Count, log once, and drop the peer that sent bad input. Never raises."""
        peer = error.peer_id or "?"
        reason = str(error).split(":", 1)[0][:60]
        if not self.penalties.reject(peer, reason, now=time.monotonic()):
            return
        logger.warning("dropping DHT peer: %s", error)
        try:
            peer_id = ID.from_base58(peer)
        except ValueError:
            return
        self.kad.routing_table.remove_peer(peer_id)
        self.providers.remove_provider(peer)
        self.ledger.drop_sender(peer)  # its value records too
        try:
            await self._host.disconnect(peer_id)
        except Exception:  # best effort; libp2p raises many kinds on a closing connection
            logger.debug("disconnecting %s failed", peer, exc_info=True)

    # -- what we store for others -----------------------------------------------------------
    def store_stats(self) -> StoreStats:
        return self.ledger.stats()

    def _store_refusal(self, peer: str, msg: Message) -> Refusal | None:
        return quota_refusal(msg, sender=peer, sender_id=ID.from_base58(peer).to_bytes(), ledger=self.ledger)

    def _note_refusal(self, peer: str, refusal: Refusal) -> None:
        """Count a refused store request; log at most one line a minute (a flood is one event)."""
        self.ledger.refused[refusal] += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            self._refusals_logged_at = now
            stats = self.ledger.stats()
            logger.info(
                "refusing DHT records from %s (%s); storing %d records, %d bytes for %d peers; refused so far: %s",
                peer, refusal.value, stats.records, stats.bytes, stats.senders, stats.refused,
            )

    # -- routing table ----------------------------------------------------------------------
    def routing_table_size(self) -> int:
        return self.kad.get_routing_table_size()

    async def bootstrap(self) -> int:
        """Seed the routing table from connected peers, then look ourselves up."""
        for peer in self._host.get_connected_peers():
            await self.kad.routing_table.add_peer(peer)
        if self._host.get_connected_peers() or self.routing_table_size():
            await self.kad.peer_routing.find_closest_peers_network(self._host.get_id().to_bytes())
        return self.routing_table_size()

    # -- content routing --------------------------------------------------------------------
    async def provide(self, key: bytes) -> bool:
        return await self.content.provide(key)

    async def find_providers(
        self,
        key: bytes,
        *,
        enough: int | None = None,
        include_local: bool = True,
        on_provider: Callable[[PeerInfo], None] | None = None,
    ) -> LookupResult:
        """Walk the DHT for providers of ``key``; each provider appears once."""
        return await self.content.find_providers(
            key, enough=enough, include_local=include_local, on_provider=on_provider
        )

    def expire_records(self) -> None:
        """Drop provider records past their TTL and value records past their expiry; forget
        ledger entries of records the library dropped on its own."""
        self.providers.cleanup_expired()
        for key, (record, _) in list(self.values.store.items()):
            try:
                self.validator.validate(key.decode(), record.value)
            except (InvalidRecord, UnicodeDecodeError):
                self.values.remove(key)
        self.ledger.reconcile([*self.providers.entries(), *self.values.entries()])

    # -- value records ----------------------------------------------------------------------
    async def put_record(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``/lattica/<kind>/<name>``; republished until forgotten."""
        _, seq = self._published.get(key, (b"", -1))
        raw = self._envelope(value, seq + 1)
        try:
            self.validator.validate(key, raw)
        except InvalidRecord as exc:
            raise LocalProtocolError(f"refusing to publish {key!r}: {exc}") from None
        self._published[key] = (value, seq + 1)
        await self.kad.put_value(key, raw)

    async def get_record(self, key: str) -> bytes | None:
        raw = await self.kad.get_value(key)
        if raw is None:
            return None
        ns_validator = self.validator.validator_by_key(key)
        if not isinstance(ns_validator, ExpiringRecordValidator):
            return None
        try:
            return ns_validator.decode(key, raw).value
        except InvalidRecord:
            self.kad.value_store.remove(key.encode())
            return None

    def forget_record(self, key: str) -> None:
        self._published.pop(key, None)

    async def republish_records(self) -> None:
        for key, (value, seq) in list(self._published.items()):
            raw = self._envelope(value, seq)
            self.kad.value_store.remove(key.encode())  # replace our own local copy
            try:
                await self.kad.put_value(key, raw)
            except Exception as exc:  # noqa: BLE001 - network: libp2p raises many kinds; retried next period
                logger.debug("republishing %s failed: %r", key, exc)

    def _envelope(self, value: bytes, seq: int) -> bytes:
        expires_at = time.time() + self._config.record_ttl
        return encode_record(ExpiringRecord(value=value, seq=seq, expires_at=expires_at))

    async def connect(self, info: PeerInfo) -> bool:
        if info.peer_id == self._host.get_id():
            return False
        try:
            with trio.fail_after(self._config.query_timeout):
                await self._host.connect(info)
        except Exception as exc:  # noqa: BLE001 - network: any dial failure means not connected
            logger.debug("connecting to %s failed: %r", info.peer_id, exc)
            return False
        return True
