"""Hole punching: upgrade a relayed connection to a direct one with DCUtR (``/libp2p/dcutr``).

Theory of operation. Over the relayed connection, the initiator sends CONNECT with its
predicted external addresses (observed IP x listen port), the responder answers CONNECT with
its own, the initiator measures the RTT, sends SYNC and waits RTT/2; then both sides dial each
other's addresses at the same moment *from their listen port* (SO_REUSEPORT), so that each
NAT sees an outgoing flow before the peer's SYN arrives and lets it in: a TCP simultaneous
open. Through port-preserving NATs this yields a direct connection; through a symmetric NAT
(a fresh external port per destination) the predicted port is wrong and the punch fails, so
the peers stay relayed. After success the relayed connection is closed after a grace period.

We use py-libp2p 0.8.1's ``DCUtRProtocol`` for the message exchange and the dials, with three
changes made in a subclass (through the hooks ``lattica.net.libp2p_compat.DCUtRHooks`` opens): no
background "auto-drive" loop (the ``Dialer`` decides when to punch, so two sides never start
competing sessions); no "unilateral" direct dial before the exchange (the dialer has just tried
that, and its timeout would delay the punch); and a bounded number of short rounds (``rounds`` x
``round_timeout``) instead of 3 x 5 s + pauses.
"""

from __future__ import annotations

import functools
import logging

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr
from trio_typing import TaskStatus

from lattica.net.libp2p_compat import DCUtRHooks, tcp_listen_endpoints
from lattica.net.nat.addresses import is_circuit

logger = logging.getLogger(__name__)


class _BoundedDCUtR(DCUtRHooks):
    def __init__(self, host: IHost, *, rounds: int, round_timeout: float,
                 dial_timeout: int) -> None:
        super().__init__(host, read_timeout=10, write_timeout=10, dial_timeout=dial_timeout)
        self._rounds = rounds
        self._round_timeout = round_timeout

    async def drive(self) -> None:
        await trio.sleep_forever()

    def busy_with(self, peer_id: ID) -> bool:
        """A session with ``peer_id`` is running (ours or one the peer started)."""
        return self.session_running(peer_id)

    def allow_new_attempts(self, peer_id: ID) -> None:
        """The library stops after 3 attempts per connection; our caller paces retries."""
        self.forget_attempts(peer_id)

    async def direct_dial_first(self, peer_id: ID) -> bool:
        return await self.connected_directly(peer_id)

    async def punch(self, peer_id: ID, addrs: list[Multiaddr], *, as_responder: bool = False) -> bool:
        targets = [a for a in addrs if not is_circuit(a)][:8]
        if not targets:
            return False
        source = next(iter(tcp_listen_endpoints(self.host)), None)
        for round_no in range(self._rounds):
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(
                        functools.partial(self.dial_from, peer_id, addr, source, as_responder=as_responder),
                    )
                with trio.move_on_after(self._round_timeout):
                    while not await self.connected_directly(peer_id):
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            if await self.connected_directly(peer_id):
                self.close_relay_later(peer_id)
                return True
            logger.debug("hole punch round %d to %s failed", round_no + 1, peer_id)
        return False


class HolePuncher:
    def __init__(self, host: IHost, *, rounds: int = 2, round_timeout: float = 3.0,
                 dial_timeout: int = 3) -> None:
        if rounds < 1 or round_timeout <= 0 or dial_timeout <= 0:
            raise ValueError("rounds, round_timeout and dial_timeout must be positive")
        self._host = host
        self._rounds = rounds
        self._round_timeout = round_timeout
        self.protocol = _BoundedDCUtR(host, rounds=rounds, round_timeout=round_timeout,
                                      dial_timeout=dial_timeout)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    async def upgrade(self, peer_id: ID) -> bool:
        """Try to turn the relayed connection to ``peer_id`` into a direct one.

        When the peer is already punching towards us (both sides dialed each other over the
        relay), join its session instead of starting a competing one: wait for it to end and
        report whether a direct connection came of it.
        """
        try:
            if self.protocol.busy_with(peer_id):
                with trio.move_on_after(self.session_budget):
                    while self.protocol.busy_with(peer_id):
                        await trio.sleep(0.05)
                return await self.protocol.connected_directly(peer_id)
            self.protocol.allow_new_attempts(peer_id)
            return await self.protocol.initiate_hole_punch(peer_id)
        except Exception as exc:  # noqa: BLE001 - the library raises many kinds and logs details; a failed punch is not fatal
            logger.info("hole punch to %s failed: %r", peer_id, exc)
            return False

    @property
    def session_budget(self) -> float:
        """An upper bound on one session: the message exchange and every round."""
        return 10.0 + self._rounds * self._round_timeout
