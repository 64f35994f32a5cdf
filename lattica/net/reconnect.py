"""Staying connected to the peers a node knows: bootstrap peers and members, across restarts.

Theory of operation: ``Reconnector`` keeps two promises of the connectivity.

- **Redial.** Every ``_TICK_S`` it dials the candidates ``RedialSchedule`` says are due: the
  bootstrap peers (at their ``--peer`` addresses, so start-up's per-address errors stay
  current for ``lattica doctor``) and the members it was connected to (at the addresses they
  vouched for themselves). A peer that said goodbye is a candidate too, at the slower pace of
  ``RedialPolicy``: the swarm's founder has no ``--peer`` to come back through, so the others
  must find it when it restarts. A member lost this long ago (``forget_after_s``) is no longer
  redialed in this life; bootstrap peers always are. At most ``_MAX_DIALS_PER_TICK`` dials
  start per tick, the most recently connected members first.
- **Memory.** The members it was connected to are saved to the data dir
  (``saved_peers.save_peers``: atomic, 0600, bounded) every ``_SAVE_INTERVAL_S`` when they
  changed, and when the node stops. A restarted node loads them (``restore``, validated as
  untrusted input) and, when it has no ``--peer``, gives them ``wait_s`` to answer before its
  services start (``reach_remembered``), so a restarted founder rejoins its swarm instead of
  starting alone; when none answers it starts anyway (the swarm may be gone) and keeps
  redialing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import trio

from lattica.net.peerbook import PeerBook, PeerRecord
from lattica.net.redial import RedialPolicy, RedialSchedule
from lattica.net.saved_peers import SavedPeer, load_saved_peers, save_peers, saved_from_book

log = logging.getLogger(__name__)

_TICK_S = 0.5
_MAX_DIALS_PER_TICK = 16
_SAVE_INTERVAL_S = 10.0
_REFRESH_SAVED_S = 300.0  # rewrite an unchanged book this often, for its last-connected times


class KnownPeerDialer(Protocol):
    """What the reconnector needs of the connectivity: its connections and two ways to dial."""

    def connected_ids(self) -> set[str]: ...

    def is_dialing(self, peer_id: str) -> bool: ...

    async def dial_bootstrap(self, addr: str) -> bool: ...

    async def dial_known(self, peer_id: str, addrs: list[str]) -> bool: ...


class Reconnector:
    def __init__(
        self, peer_book: PeerBook, *, dialer: KnownPeerDialer, data_dir: Path,
        bootstrap: Mapping[str, Sequence[str]], policy: RedialPolicy, forget_after_s: float = 3600.0,
    ) -> None:
        self.peer_book = peer_book
        self._dialer = dialer
        self._data_dir = data_dir
        self._bootstrap = {peer_id: list(addrs) for peer_id, addrs in bootstrap.items()}  # id -> --peer addrs
        self._schedule = RedialSchedule(policy)
        self._forget_after_s = forget_after_s
        self._lost_at: dict[str, float] = {}  # member -> when its redials began
        self._saved: list[tuple[str, tuple[str, ...]]] | None = None  # what the file holds
        self._saved_at = -_REFRESH_SAVED_S
        self._save_failure: str | None = None
        self._saving = trio.Lock()  # the periodic save and the one at shutdown share a temporary

    # -- memory ----------------------------------------------------------------------------

    def restore(self) -> int:
        """Put the saved members into the peer book; how many there were."""
        now = time.time()
        peers = load_saved_peers(self._data_dir, self_id=self.peer_book.self_id, now=now)
        for peer in peers:
            self.peer_book.remember(peer.peer_id, list(peer.addrs), last_connected=peer.last_connected, now=now)
        self._saved = _fingerprint(peers)
        return len(peers)

    async def save(self) -> None:
        """Write the saved book now when it changed (or is due for a refresh)."""
        async with self._saving:
            await self._save()

    async def _save(self) -> None:
        peers = saved_from_book(self.peer_book.records())
        fingerprint = _fingerprint(peers)
        now = trio.current_time()
        if fingerprint == self._saved and now - self._saved_at < _REFRESH_SAVED_S:
            return
        try:
            await trio.to_thread.run_sync(save_peers, self._data_dir, peers)
        except OSError as exc:
            if exc.strerror != self._save_failure:  # once per cause, not every interval
                log.warning("cannot save the peer book in %s: %s", self._data_dir, exc.strerror)
            self._save_failure = exc.strerror
            return
        self._saved, self._saved_at, self._save_failure = fingerprint, now, None

    async def reach_remembered(self, *, wait_s: float) -> int:
        """Dial the remembered members at once and wait up to ``wait_s`` for one to answer;
        how many did."""
        now = trio.current_time()
        remembered = [r for r in self._candidates() if r.peer_id not in self._bootstrap][:_MAX_DIALS_PER_TICK]
        if not remembered:
            return 0
        with trio.move_on_after(wait_s):
            async with trio.open_nursery() as nursery:
                for record in remembered:
                    self._schedule.due(record.peer_id, now=now, left=False)  # this is its first dial
                    nursery.start_soon(self._dial_remembered, record.peer_id, list(record.addrs), nursery.cancel_scope)
        answered = len(set(self._dialer.connected_ids()) & {r.peer_id for r in remembered})
        if answered:
            log.info("reconnected to %d of %d member(s) known from before", answered, len(remembered))
        else:
            log.warning(
                "none of the %d member(s) known from before answered within %g s; starting without them "
                "(they are redialed in the background)", len(remembered), wait_s,
            )
        return answered

    async def _dial_remembered(self, peer_id: str, addrs: list[str], done: trio.CancelScope) -> None:
        if await self._dialer.dial_known(peer_id, addrs):
            done.cancel()

    # -- redial ----------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._save_loop)
            while True:
                self._redial_due(nursery)
                await trio.sleep(_TICK_S)

    def _redial_due(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        candidates = self._candidates()
        self._schedule.keep_only({r.peer_id for r in candidates})
        self._lost_at = {r.peer_id: self._lost_at.get(r.peer_id, now) for r in candidates}
        started = 0
        for record in candidates:
            if started >= _MAX_DIALS_PER_TICK:
                break
            peer_id = record.peer_id
            if peer_id not in self._bootstrap and now - self._lost_at[peer_id] > self._forget_after_s:
                continue
            if self._dialer.is_dialing(peer_id) or not self._schedule.due(peer_id, now=now, left=record.left):
                continue
            nursery.start_soon(self._redial, record)
            started += 1

    def _candidates(self) -> list[PeerRecord]:
        """Not connected: bootstrap peers first, then members, the most recently connected first."""
        connected = self._dialer.connected_ids()
        records = [
            r for r in self.peer_book.records()
            if r.peer_id not in connected and (r.peer_id in self._bootstrap or (r.member and r.last_connected > 0))
        ]
        records.sort(key=lambda r: (r.peer_id not in self._bootstrap, -r.last_connected))
        return records

    async def _redial(self, record: PeerRecord) -> None:
        peer_id = record.peer_id
        if peer_id in self._bootstrap:
            for addr in self._bootstrap[peer_id]:
                if await self._dialer.dial_bootstrap(addr):
                    log.info("reconnected to bootstrap peer %s", peer_id)
                    return
        elif await self._dialer.dial_known(peer_id, list(record.addrs)):
            log.info("reconnected to %s", peer_id)

    async def _save_loop(self) -> None:
        while True:
            await trio.sleep(_SAVE_INTERVAL_S)
            await self.save()


def _fingerprint(peers: list[SavedPeer]) -> list[tuple[str, tuple[str, ...]]]:
    return sorted((p.peer_id, p.addrs) for p in peers)
