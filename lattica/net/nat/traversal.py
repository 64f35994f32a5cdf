"""The NAT path machinery one node dials through, started as one unit.

AutoNAT (``ReachabilityService``), the circuit relay v2 server (serving while public), the
DCUtR hole puncher, the path book and the ``Dialer`` that uses them: direct first, then the
peer's relay addresses, then a hole punch to upgrade a relayed connection. They start in that
order; once ``run`` has reported started, ``dialer`` may be used. What the daemon does with the
verdicts (reservations, advertised addresses, the peer table) is ``lattica.node.nat_service``.
"""

from __future__ import annotations

import trio
from libp2p.abc import IHost
from trio_typing import TaskStatus

from lattica.net.nat.autonat import ReachabilityService
from lattica.net.nat.dialer import Dialer
from lattica.net.nat.holepunch import HolePuncher
from lattica.net.nat.paths import PathBook
from lattica.net.nat.relay import RelayServer


class NatTraversal:
    def __init__(self, host: IHost) -> None:
        self.reachability = ReachabilityService(host)
        self.relay_server = RelayServer(host, serve="auto", reachability=self.reachability)
        self.hole_puncher = HolePuncher(host)
        self.paths = PathBook(host)
        self.dialer = Dialer(host, relay=self.relay_server, paths=self.paths, holepuncher=self.hole_puncher)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.relay_server.run)
            await nursery.start(self.hole_puncher.run)
            await nursery.start(self.paths.run)
            await nursery.start(self.dialer.run)
            await nursery.start(self.reachability.run)
            task_status.started()
