"""Agreeing on who takes part in a sync: a coordinator per sync key, chosen from the run state.

Theory of operation: the candidates of a sync are the live training members of the run (from
the replicated state's leases). Every candidate sends ``{"key", "run"}`` on
``/lattica/round/1.0.0`` to the *coordinator* — the candidate with the smallest peer id (itself,
possibly). The coordinator collects ready peers for the key until every candidate is ready or
``deadline_s`` has passed since the first one arrived, then answers all of them with the same
sorted group. Only *responsive* candidates are waited for (by default: those we hold a
connection to; the daemon also requires a lease renewal seen in the last few seconds): a killed
peer keeps its lease for a few seconds and a silently cut one even keeps its connection, and
waiting for either would stall the round up to the deadline. An unresponsive candidate is also
skipped as coordinator, and an asker stops waiting for a coordinator that turns unresponsive. A peer
that arrives after the group is sealed gets the sealed group without itself in it and syncs alone;
the training service then catches it up by fetching the agreed outer weights. If the coordinator
cannot be reached within ``_OPEN_TIMEOUT_S``, the next candidate by peer id is asked — so the
deadline must be well above that, or peers that notice a dead coordinator at different times end up
in different groups.

A key ``<base>/retry/<n>`` (DiLoCo's second attempt after a failed all-reduce) is asked for only
by the members of the attempt before it: when the coordinator knows that group (it sealed or
received it), only those members are waited for, not every candidate; its askers, who all know
that group, pick their coordinator among its members.

Peers can disagree for a moment about who is responsive (a peer back from a restart or a cut is
heard by some before others), and then about who coordinates: a coordinator C would wait for a
lower candidate L that is coordinating a group of its own, and L for C's askers, both until the
deadline, each sealing a part of the round. So the lower id wins as soon as anyone notices: a
coordinator that sees a responsive candidate below itself while a key is pending answers its
askers ``{"redirect": L}`` and they (and C itself) ask L — also an asker whose view of the
members does not list L yet. Redirects only go down in peer id, so they end. A coordinator
that redirected us is not given up on: when the peer it named fails (it died, and we noticed
before the redirecting one did), we ask the redirecting one again after a short pause — its
view catches up within ``_OPEN_TIMEOUT_S`` — rather than coordinating alone while it waits for
us (two survivors of a dead coordinator sealed a 1-member round each). One that keeps naming a
failed peer for a whole deadline counts as failed itself.

Given the published rounds, a candidate two or more behind the round at least half the
candidates have published (it is fetching the run's state) is not waited for, and only
candidates at that round or later coordinate — except a member of our group of the round
before: it kept pace, and its record of that round may just not have reached us yet.

Invariants: a key is sealed once, so everyone who was answered got the same group; groups are
sorted, so every member sees the same order; memory is bounded by keeping the last
``MAX_KEYS`` sealed keys.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from trio_typing import TaskStatus

from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.net.wire import read_message, write_message

log = logging.getLogger(__name__)

ROUND_PROTOCOL = TProtocol("/lattica/round/1.0.0")
MAX_KEYS = 256
MAX_KEY_LEN = 200
_REQUEST_BYTES = 1024
_REPLY_BYTES = 256 * 1024
_OPEN_TIMEOUT_S = 3.0
_STALE_REDIRECT_PAUSE_S = 0.25
_RETRY = re.compile(r"^(.+)/retry/(\d+)$")
_ROUND = re.compile(r"^round/(\d+)(?:/retry/\d+)?$")  # blocking strategies' keys, in round order
_FRAGMENT = re.compile(r"^round/\d+/fragment/\d+$")  # Streaming DiLoCo's overlapped fragment syncs


def round_of(key: str) -> int | None:
    """The round number of a blocking round key (``round/N``, ``round/N/retry/k``), else None
    (keys such as ``round/N/fragment/f`` of overlapping syncs are not ordered this way)."""
    match = _ROUND.match(key)
    return None if match is None else int(match.group(1))


@dataclass
class _PendingSync:
    first_arrival: float
    ready: set[str] = field(default_factory=set)
    group: tuple[str, ...] | None = None
    redirect: str | None = None  # a lower candidate coordinates this key instead
    sealed: trio.Event = field(default_factory=trio.Event)


@dataclass
class _CoordinatorSearch:
    """One ``group_for``'s way to its coordinator, without I/O: whose ask failed, where we were
    last sent, and since when a coordinator keeps sending us to a peer that already failed."""

    patience_s: float
    failed: set[str] = field(default_factory=set)
    redirect: str | None = None
    stale_since: dict[str, float] = field(default_factory=dict)

    def take_redirect(self) -> str | None:
        redirect, self.redirect = self.redirect, None
        return redirect

    def on_failure(self, coordinator: str) -> None:
        self.failed.add(coordinator)

    def on_redirect(self, coordinator: str, to: str, now: float) -> bool:
        """Follow a redirect; True when it names a peer that failed us, and the redirecting
        coordinator should be asked again after a pause (or, past the patience, counts as
        failed — then False)."""
        if to not in self.failed:
            self.redirect = to
            return False
        first = self.stale_since.setdefault(coordinator, now)
        if now - first >= self.patience_s:
            self.failed.add(coordinator)
            return False
        return True


class _Redirected(Exception):
    def __init__(self, coordinator: str) -> None:
        super().__init__(f"redirected to {coordinator}")
        self.coordinator = coordinator


class RoundCoordinator:
    """A ``GroupProvider`` for strategies, backed by the run's live members."""

    def __init__(
        self,
        host: IHost,
        *,
        peer_id: str,
        run_id: str,
        candidates: Callable[[], Sequence[str]],
        deadline_s: float,
        responsive: Callable[[str], bool] | None = None,
        published_round: Callable[[str], int | None] | None = None,
    ) -> None:
        self.host = host
        self.peer_id = peer_id
        self.run_id = run_id
        self.candidates = candidates
        self.deadline_s = deadline_s
        self.responsive = responsive or self._connected
        self.published_round = published_round
        self._failed: dict[str, float] = {}  # coordinator -> when asking it last failed
        self._syncs: OrderedDict[str, _PendingSync] = OrderedDict()
        self._groups: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # groups we sealed or got
        self._asked_round: OrderedDict[str, int] = OrderedDict()  # peer -> round of its latest request
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_stream_handler(ROUND_PROTOCOL, self._handle)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def _candidates(self) -> list[str]:
        return sorted(set(self.candidates()) | {self.peer_id})

    def _connected(self, peer: str) -> bool:
        return any(p.to_base58() == peer for p in self.host.get_connected_peers())

    async def group_for(self, key: str) -> Sequence[str]:
        search = _CoordinatorSearch(patience_s=self.deadline_s)
        while True:
            redirected_to = search.take_redirect()
            coordinator = self._next_coordinator(key, search.failed, redirected_to)
            if coordinator is None:
                return (self.peer_id,)
            try:
                if coordinator == self.peer_id:
                    group = await self._join(key, self.peer_id)
                else:
                    group = await self._ask(coordinator, key, vouched=coordinator == redirected_to)
            except _Redirected as exc:
                log.info("coordinator %s for %s redirects to %s", coordinator, key, exc.coordinator)
                if search.on_redirect(coordinator, exc.coordinator, trio.current_time()):
                    await trio.sleep(_STALE_REDIRECT_PAUSE_S)  # its view of the failed peer lags ours
                elif coordinator in search.failed:
                    self._failed[coordinator] = trio.current_time()
                continue
            except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a dead peer
                log.info("coordinator %s unavailable for %s: %r", coordinator, key, exc)
                search.on_failure(coordinator)
                self._failed[coordinator] = trio.current_time()
                continue
            self._learn(key, group)
            return group if self.peer_id in group else (self.peer_id,)

    def _next_coordinator(self, key: str, failed: set[str], redirect: str | None) -> str | None:
        """The coordinator to ask next: the one we were redirected to, else the lowest responsive
        candidate whose ask has not failed (one that only redirected us may be asked again) —
        looked up afresh after every failure, so a peer that became responsive meanwhile (back
        from a restart) is not passed over. For a retry key, the
        members of the previous attempt when we know them: every asker knows them.

        A redirect is followed even to a peer that is not among our candidates: the coordinator
        that sent us there hears it, and our own view of the members can lag (back from a link
        cut, the others' leases look expired until their renewals arrive). Passing it over sent
        us back to the same coordinator, which redirected again, for the rest of the round."""
        if redirect is not None and redirect not in failed:
            return redirect
        pool = self._candidates()
        expected = self._expected(key)
        if expected is not None and self.peer_id in expected:
            pool = sorted(expected & set(pool))
        behind = self._behind(1, key=key)
        for coordinator in pool:
            if coordinator in failed:
                continue
            if coordinator == self.peer_id or (self._can_coordinate(coordinator) and coordinator not in behind):
                return coordinator
        return None

    def _can_coordinate(self, peer: str) -> bool:
        """Responsive, and asking it did not just fail (its connection may not have dropped yet)."""
        failed = self._failed.get(peer)
        if failed is not None and trio.current_time() - failed < self.deadline_s:
            return False
        return self.responsive(peer)

    def _behind(self, rounds: int = 2, *, key: str | None = None) -> set[str]:
        """Candidates whose published round is ``rounds`` or more behind the swarm's (or who
        published none while others have). Two behind: catching up (back from a restart or a
        cut, fetching the run's state, which takes rounds) — not waited for; one behind is the
        ordinary lag of a peer still finishing the previous sync. A coordinator must be up to
        date: a peer that just fetched the state of the round before (the others finished one
        more meanwhile) then coordinated the next round, which it reached only 5 s later.

        The swarm's round is the one at least half the candidates have published, not the
        newest: measured against a lone peer ahead, everyone else looked behind and it sealed
        its rounds alone at once. Relative, so a round every replica skipped (keys move on,
        completed rounds do not) shifts nobody.

        For a fragment sync (``round/N/fragment/f``), one round more of slack, and a peer that
        published nothing yet counts as at round -1: its round number counts fragment syncs
        applied (÷ P), which a peer at the same sync may have done one more of, and a first
        record replicates with a lag — in a two-peer swarm the peer behind by that lag lost its
        coordinator role, each peer sealed the sync alone, and eager replicas kept the split."""
        if self.published_round is None:
            return set()
        published = {p: self.published_round(p) for p in self._candidates()}
        known = sorted((r for r in published.values() if r is not None), reverse=True)
        if not known:
            return set()
        swarm = known[(len(known) - 1) // 2]
        if key is not None and _FRAGMENT.match(key):
            rounds += 1
            return {p for p, r in published.items() if p != self.peer_id and swarm - (-1 if r is None else r) >= rounds}
        kept_pace = self._synced_the_round_before(key)
        return {
            p for p, r in published.items()
            if p != self.peer_id and p not in kept_pace and (r is None or swarm - r >= rounds)
        }

    def _synced_the_round_before(self, key: str | None) -> set[str]:
        """The members of our group for the round before ``key``'s: they synced with us one round
        ago, whatever their published record says yet. That record replicates with a lag, and
        read before it arrived, such a peer looked as if it published nothing while we had: we
        sealed the round without it and it ran the round alone (rounds of a few inner steps
        follow each other within a fraction of a second)."""
        rnd = None if key is None else round_of(key)
        if not rnd:
            return set()
        return {p for k, group in self._groups.items() if round_of(k) == rnd - 1 for p in group}

    def _learn(self, key: str, group: Sequence[str]) -> None:
        self._groups[key] = tuple(group)
        while len(self._groups) > MAX_KEYS:
            self._groups.popitem(last=False)

    def _expected(self, key: str) -> set[str] | None:
        """For a retry key, the members of the attempt before it, when we know that group."""
        match = _RETRY.match(key)
        if match is None:
            return None
        base, attempt = match.group(1), int(match.group(2))
        previous = base if attempt <= 1 else f"{base}/retry/{attempt - 1}"
        group = self._groups.get(previous)
        return None if group is None else set(group)

    async def _ask(self, coordinator: str, key: str, *, vouched: bool = False) -> tuple[str, ...]:
        """``vouched``: another coordinator sent us here, having found it responsive; we may not
        have heard it long enough to say so ourselves, so we give up on it only when our
        connection to it drops (or at the time limit)."""
        # a coordinator that is gone must be given up on quickly, so that the next one in line
        # still collects everyone within the deadline; one that answers may hold us until it seals
        with trio.fail_after(_OPEN_TIMEOUT_S):
            stream = await self.host.new_stream(ID.from_base58(coordinator), [ROUND_PROTOCOL])
        alive = self._connected if vouched else self.responsive
        try:
            # it seals at most a deadline after our request arrives; longer means it went silent
            with trio.fail_after(self.deadline_s + _OPEN_TIMEOUT_S):
                reply = await self._while_alive(alive, coordinator, self._request, stream, coordinator, key)
        finally:
            await stream.close()
        redirect = reply.get("redirect") if isinstance(reply, dict) else None
        if isinstance(redirect, str) and len(redirect) <= MAX_KEY_LEN and redirect < coordinator:
            raise _Redirected(redirect)
        group = reply.get("group") if isinstance(reply, dict) else None
        if not isinstance(group, list) or not all(isinstance(p, str) for p in group):
            raise RemoteProtocolError("malformed round reply", peer_id=coordinator)
        return tuple(group)

    async def _request(self, stream: INetStream, coordinator: str, key: str) -> object:
        await write_message(stream, {"key": key, "run": self.run_id}, peer_id=coordinator)
        return await read_message(stream, max_size=_REPLY_BYTES, peer_id=coordinator)

    async def _while_alive(
        self, alive: Callable[[str], bool], peer: str, fn: Callable[..., Awaitable[object]], *args: object
    ) -> object:
        """``await fn(*args)``, abandoned with ``PeerUnavailableError`` once ``alive(peer)`` turns
        false (a coordinator cut off while we wait for its group)."""
        result: object = None
        with trio.CancelScope() as watched:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._cancel_when_dead, alive, peer, watched)
                    result = await fn(*args)
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:  # fn's own failure, as itself
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
        if watched.cancelled_caught:
            raise PeerUnavailableError("coordinator stopped responding", peer_id=peer)
        return result

    async def _cancel_when_dead(self, alive: Callable[[str], bool], peer: str, scope: trio.CancelScope) -> None:
        while alive(peer):
            await trio.sleep(0.1)
        scope.cancel()

    async def _join(self, key: str, peer: str) -> tuple[str, ...]:
        self._note_round(key, peer)
        pending = self._syncs.get(key)
        if pending is None:
            pending = self._syncs[key] = _PendingSync(first_arrival=trio.current_time())
            while len(self._syncs) > MAX_KEYS:
                self._syncs.popitem(last=False)
            assert self._nursery is not None, "RoundCoordinator.run must be started first"
            self._nursery.start_soon(self._seal_when_ready, key, pending)
        if pending.group is None and pending.redirect is None:
            pending.ready.add(peer)
        await pending.sealed.wait()
        if pending.redirect is not None:
            raise _Redirected(pending.redirect)
        assert pending.group is not None
        return pending.group

    def _note_round(self, key: str, peer: str) -> None:
        rnd = round_of(key)
        if rnd is None:
            return
        self._asked_round[peer] = rnd
        self._asked_round.move_to_end(peer)
        while len(self._asked_round) > MAX_KEYS:
            self._asked_round.popitem(last=False)

    def _moved_on(self, peer: str, key: str) -> bool:
        """Whether ``peer``'s latest request was for a later round than ``key``'s: a blocking
        strategy never asks for an older round again, so waiting for it would only hold the
        round until the deadline (a peer that restarted behind asks for its round again)."""
        rnd, asked = round_of(key), self._asked_round.get(peer)
        return rnd is not None and asked is not None and asked > rnd

    def _fell_behind(self, key: str) -> bool:
        """Whether our own latest request was for a round at least two before ``key``'s: we are
        catching up (back from a cut) and will not ask for ``key`` soon; one round behind is
        ordinary (the others finished their inner steps first)."""
        rnd, asked = round_of(key), self._asked_round.get(self.peer_id)
        return rnd is not None and asked is not None and rnd - asked >= 2

    def _awaited(self, key: str) -> set[str]:
        """Candidates worth waiting for: an unresponsive one (killed, cut off) would only hold
        the round until the deadline, and so would one already asking for a later round; for a
        retry, only the previous attempt's members come."""
        awaited = {
            p for p in self._candidates()
            if (p == self.peer_id or self.responsive(p)) and not self._moved_on(p, key)
        }
        if self._fell_behind(key):
            awaited.discard(self.peer_id)
        awaited -= self._behind(key=key)
        expected = self._expected(key)
        return awaited if expected is None else awaited & expected

    def _outranked(self, key: str) -> str | None:
        """A responsive candidate below us, which coordinates ``key`` for whoever sees it: the
        lowest such. For a retry key, only members of the previous attempt count (its askers
        pick among them)."""
        pool = set(self._candidates())
        expected = self._expected(key)
        if expected is not None:
            pool &= expected
        behind = self._behind(1, key=key)
        lower = sorted(p for p in pool if p < self.peer_id and p not in behind and self._can_coordinate(p))
        return lower[0] if lower else None

    async def _seal_when_ready(self, key: str, pending: _PendingSync) -> None:
        with trio.move_on_at(pending.first_arrival + self.deadline_s):
            while not self._awaited(key) <= pending.ready:
                lower = self._outranked(key)
                if lower is not None:
                    # everyone who asked us goes there (so do we); a later request starts afresh
                    pending.redirect = lower
                    if self._syncs.get(key) is pending:
                        del self._syncs[key]
                    pending.sealed.set()
                    return
                await trio.sleep(0.05)
        # a peer that went silent after it asked (its link was cut while we waited) would only
        # stall the all-reduce until the stall guard gives up; it is answered like a late peer
        pending.group = tuple(sorted(p for p in pending.ready if p == self.peer_id or self.responsive(p)))
        self._learn(key, pending.group)
        pending.sealed.set()
        missing = set(self._candidates()) - set(pending.group)
        if missing:
            log.info(
                "sync %s sealed with %d peer(s) after %.2f s, without %d late peer(s)", key,
                len(pending.group), trio.current_time() - pending.first_arrival, len(missing),
            )

    async def _handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(self.deadline_s + 10):
                request = await read_message(stream, max_size=_REQUEST_BYTES, peer_id=peer)
                key = request.get("key") if isinstance(request, dict) else None
                if (
                    not isinstance(request, dict) or not isinstance(key, str) or len(key) > MAX_KEY_LEN
                    or request.get("run") != self.run_id
                ):
                    raise RemoteProtocolError("malformed round request", peer_id=peer)  # noqa: TRY301 - logged below like any failed request
                try:
                    reply: dict[str, object] = {"group": list(await self._join(key, peer))}
                except _Redirected as exc:
                    reply = {"redirect": exc.coordinator}
                await write_message(stream, reply, peer_id=peer)
        except Exception as exc:  # noqa: BLE001 - one bad request ends one stream
            log.debug("round request from %s failed: %r", peer, exc)
        finally:
            await stream.close()
