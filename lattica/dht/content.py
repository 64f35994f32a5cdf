"""Content routing: announce and find holders of a key, over any ``ProviderLookup``.

``find_providers`` drives the sans-IO ``ProviderLookup`` with real GET_PROVIDERS RPCs, at most
``parallelism`` in flight, each bounded by ``query_timeout`` — the dial of a peer not yet
connected included (``reach.py``) — and hands each provider to the caller as soon as it is
learned. Unlike py-libp2p's own
``find_providers`` it always walks the network (the library returns only local records when
it has any, so a member that provides the run key would only ever find itself), merges the
local store, and returns each provider once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht.config import DHTConfig
from lattica.dht.lookup import ProviderLookup
from lattica.dht.reach import PeerReacher
from lattica.dht.rpc import ProvidersAnswer, ResponseCaps, get_providers
from lattica.errors import PeerUnavailableError, RemoteProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupResult:
    providers: list[PeerInfo]
    hops: int | None
    queries: int
    elapsed: float


class ContentRouting:
    def __init__(
        self,
        host: IHost,
        kad: KadDHT,
        config: DHTConfig,
        *,
        on_bad_answer: Callable[[RemoteProtocolError], Awaitable[None]],
        reacher: PeerReacher,
    ) -> None:
        self._host = host
        self._kad = kad
        self._config = config
        self._on_bad_answer = on_bad_answer
        self._reacher = reacher
        self._caps = ResponseCaps(
            max_message=config.max_message_bytes,
            max_providers=config.max_providers_per_response,
            max_addrs=config.max_addrs_per_peer,
            width=config.lookup_width,
        )

    async def provide(self, key: bytes) -> bool:
        """Announce this node as a provider of ``key`` to the closest peers."""
        return await self._kad.provider_store.provide(key)

    def stop_providing(self, key: bytes) -> None:
        store = self._kad.provider_store
        store.providing_keys.discard(key)
        store.providers.get(key, {}).pop(str(self._host.get_id()), None)

    def seeds(self) -> list[ID]:
        width = self._config.lookup_width
        peers = list(self._kad.routing_table.get_peer_ids())
        if len(peers) < width:
            peers += [p for p in self._host.get_connected_peers() if p not in peers]
        return peers

    async def find_providers(
        self,
        key: bytes,
        *,
        enough: int | None = None,
        include_local: bool = True,
        on_provider: Callable[[PeerInfo], None] | None = None,
    ) -> LookupResult:
        """Walk for providers of ``key``. ``on_provider`` is called with each provider the
        moment the walk learns of it (once per peer), so a caller can dial it while the walk
        still waits on slow or unreachable peers."""
        started = trio.current_time()
        told: set[ID] = set()

        def tell_new() -> None:
            for info in lookup.providers:
                if info.peer_id not in told and on_provider is not None:
                    told.add(info.peer_id)
                    on_provider(info)

        lookup = ProviderLookup(
            key,
            self.seeds(),
            local_id=self._host.get_id(),
            width=self._config.lookup_width,
            parallelism=self._config.lookup_parallelism,
            enough=enough,
        )
        if include_local:
            lookup.add_local_providers(self._kad.provider_store.get_providers(key))
            tell_new()
        # Each finished query sends one token; the loop refills the in-flight window.
        finished_send, finished_recv = trio.open_memory_channel[None](math.inf)
        async with trio.open_nursery() as nursery:
            while not lookup.done:
                for peer in lookup.next_queries():
                    nursery.start_soon(self._query, lookup, peer, key, finished_send)
                await finished_recv.receive()
                tell_new()
            nursery.cancel_scope.cancel()
        return LookupResult(
            providers=lookup.providers,
            hops=lookup.first_provider_hop,
            queries=lookup.queries,
            elapsed=trio.current_time() - started,
        )

    async def _query(
        self,
        lookup: ProviderLookup,
        peer: ID,
        key: bytes,
        finished: trio.MemorySendChannel[None],
    ) -> None:
        try:
            with trio.fail_after(self._config.query_timeout):
                answer = await self._ask(peer, key)
        except RemoteProtocolError as exc:
            lookup.on_failure(peer)
            await self._on_bad_answer(exc)
        except PeerUnavailableError as exc:
            # Unreachable peers leave the routing table, as in Kademlia; slow ones stay.
            logger.debug("provider query to %s failed: %r", peer, exc)
            self._kad.routing_table.remove_peer(peer)
            lookup.on_failure(peer)
        except trio.TooSlowError:
            logger.debug("provider query to %s timed out", peer)
            lookup.on_failure(peer)
        else:
            lookup.on_response(
                peer, providers=answer.providers, closer=[p.peer_id for p in answer.closer]
            )
        finished.send_nowait(None)

    async def _ask(self, peer: ID, key: bytes) -> ProvidersAnswer:
        """GET_PROVIDERS to ``peer``, dialing it first (relay addresses included) if needed."""
        if not await self._reacher(peer):
            raise PeerUnavailableError("not reachable", peer_id=str(peer))
        return await get_providers(self._host, peer, key, caps=self._caps)
