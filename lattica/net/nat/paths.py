"""Per-peer path bookkeeping: how we reach each peer (direct / hole-punched / relayed) and RTT.

Theory of operation: the swarm may hold several connections to one peer (a relayed one, then a
direct one after a hole punch). ``PathBook`` samples them: a peer whose first connection we saw
was relayed and who later gains a direct connection is *hole-punched*; a peer first seen over a
direct connection is *direct*; one with only relayed connections is *relayed*. The path is the
best connection present now, which is also the one the swarm picks for new streams (its
default ``best`` strategy prefers direct over relayed). The book is sampled every
``sample_interval`` seconds (for ``wait_path`` and the change log), and ``path()`` / ``peers()``
re-read the connections on every call, so a query never reports a path that has since
changed. RTT is measured with libp2p ping over that connection, every ``rtt_interval``
seconds (a new peer, or one whose path changed, within 0.5 s); failures keep the last value.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetConn
from libp2p.host.ping import PingService
from libp2p.peer.id import ID
from trio_typing import TaskStatus

from lattica.net.nat.addresses import conn_is_relayed

logger = logging.getLogger(__name__)


class Path(enum.StrEnum):
    DIRECT = "direct"
    HOLE_PUNCHED = "hole-punched"
    RELAYED = "relayed"


@dataclass(frozen=True)
class PeerPath:
    peer_id: str
    path: Path
    rtt_ms: float | None
    since: float  # time.time() when this path was first observed


class PathBook:
    def __init__(self, host: IHost, *, sample_interval: float = 0.25,
                 rtt_interval: float = 5.0) -> None:
        if sample_interval <= 0 or rtt_interval <= 0:
            raise ValueError("intervals must be positive")
        self._host = host
        self._sample_interval = sample_interval
        self._rtt_interval = rtt_interval
        self._ping = PingService(host)
        self._first_relayed: set[ID] = set()
        self._paths: dict[ID, PeerPath] = {}
        self._rtt: dict[ID, float] = {}
        self._changed = trio.Condition()

    # -- queries ---------------------------------------------------------------------------
    def path(self, peer_id: ID) -> Path | None:
        """The path to ``peer_id`` as the swarm's connections show it now (not as last sampled:
        a hole punch completes within ~0.1 s, and a stream opened right after it already uses
        the direct connection)."""
        self._refresh(peer_id)
        entry = self._paths.get(peer_id)
        return entry.path if entry else None

    def rtt_ms(self, peer_id: ID) -> float | None:
        return self._rtt.get(peer_id)

    def peers(self) -> list[PeerPath]:
        self.sample()
        return [
            PeerPath(str(pid), p.path, self._rtt.get(pid), p.since)
            for pid, p in self._paths.items()
        ]

    def note_relayed(self, peer_id: ID) -> None:
        """The dialer reached ``peer_id`` through a relay before any direct connection."""
        if self.path(peer_id) is None:
            self._first_relayed.add(peer_id)

    async def wait_path(self, peer_id: ID, wanted: set[Path]) -> Path:
        """Block until ``peer_id``'s path is one of ``wanted`` (callers bound the wait)."""
        async with self._changed:
            while (current := self.path(peer_id)) not in wanted:
                await self._changed.wait()
        assert current is not None
        return current

    # -- service ---------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._rtt_loop)
            self.sample()
            task_status.started()
            while True:
                await trio.sleep(self._sample_interval)
                self.sample()
                async with self._changed:
                    self._changed.notify_all()

    def sample(self) -> None:
        connections = self._host.get_network().connections
        for peer_id in list(self._paths):
            if not connections.get(peer_id):
                self._forget(peer_id)
        for peer_id, conns in list(connections.items()):
            self._update(peer_id, conns)

    def _refresh(self, peer_id: ID) -> None:
        conns = self._host.get_network().connections.get(peer_id)
        if conns:
            self._update(peer_id, conns)
        elif peer_id in self._paths:
            self._forget(peer_id)

    def _forget(self, peer_id: ID) -> None:
        del self._paths[peer_id]
        self._rtt.pop(peer_id, None)

    def _update(self, peer_id: ID, conns: INetConn | list[INetConn]) -> None:
        kinds = [conn_is_relayed(c) for c in (conns if isinstance(conns, list) else [conns])]
        if True in kinds and peer_id not in self._paths:
            self._first_relayed.add(peer_id)
        if False in kinds:
            new = Path.HOLE_PUNCHED if peer_id in self._first_relayed else Path.DIRECT
        elif True in kinds:
            new = Path.RELAYED
        else:
            return
        old = self._paths.get(peer_id)
        if old is None or old.path != new:
            self._paths[peer_id] = PeerPath(str(peer_id), new, None, time.time())
            logger.info("path to %s is now %s", peer_id, new)

    async def _rtt_loop(self) -> None:
        # every rtt_interval per peer; a new peer, or one whose path changed (a hole punch),
        # is measured within half a second
        due: dict[ID, tuple[float, Path]] = {}
        while True:
            for peer_id, entry in list(self._paths.items()):
                when, path = due.get(peer_id, (0.0, entry.path))
                if trio.current_time() >= when or path != entry.path:
                    due[peer_id] = (trio.current_time() + self._rtt_interval, entry.path)
                    await self.measure_rtt(peer_id)
            for peer_id in [p for p in due if p not in self._paths]:
                del due[peer_id]
            await trio.sleep(min(0.5, self._rtt_interval))

    async def measure_rtt(self, peer_id: ID) -> float | None:
        with trio.move_on_after(min(self._rtt_interval, 3.0)):
            try:
                await self._ping.ping(peer_id, ping_amt=1)  # opens (or reuses) the stream
                start = time.perf_counter()
                await self._ping.ping(peer_id, ping_amt=1)  # whole-ms library value is too coarse
            except Exception as exc:  # noqa: BLE001 - network: any ping failure means no RTT sample
                logger.debug("ping %s failed: %r", peer_id, exc)
                return None
            self._rtt[peer_id] = round((time.perf_counter() - start) * 1000.0, 3)
            return self._rtt[peer_id]
        return None
