"""``ReplicatedState``: the run's shared state as a service on a libp2p host.

Theory of operation
-------------------
The service wraps a sans-IO ``Replica`` with three kinds of I/O:

- **Durability** (``durable.DurableLog``). Every envelope the replica accepts (our own writes and peers')
  is appended to ``data_dir/state-<run>.log`` and fsync'd in a worker thread. Our own writes return
  (are *acknowledged*) only after that, and are not offered to peers before it. At start the log is
  replayed through the same validation as network input; a torn tail is cut off. A full disk does not
  stop the node: the held records are written, in order, once space returns (warned once, shown in
  ``lattica status``); a kill meanwhile loses them.
- **Anti-entropy.** Waves of sync sessions (``sync.initiate``) at a change or every ``sync_interval``,
  as ``sync_plan.SyncPlan`` plans them: what changed here lately pushed to a few random peers, and
  now and then a full session with one that repairs what pushes missed. Bad or failing peers are backed off.
- **Liveness.** Every write of our record renews our lease; a heartbeat task renews it when none
  did for an interval (longer in a larger swarm, ``LeasePolicy``); ``leave()`` writes ``left`` and pushes it at once.
- Proof of presence, serving budget, equivocation, our own history: ``docs/replicated-state.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from pycrdt import Doc, Map
from trio_typing import TaskStatus

from lattica.crdt import documents, sync
from lattica.crdt.config import StateConfig
from lattica.crdt.durable import DurableLog, state_log_path
from lattica.crdt.envelope import Envelope, RejectedUpdate
from lattica.crdt.liveness import MAX_VOUCHES, Proof, ProvenPeers, is_live, live_members, present, verified_writers
from lattica.crdt.replica import Replica
from lattica.crdt.sync_plan import News, Session, SyncPlan
from lattica.errors import BrokenError, LocalProtocolError, RemoteError, RemoteProtocolError
from lattica.net.serving_budget import AnswerSlots, ServingBudget
from lattica.net.streams import close_quietly, reset_quietly

log = logging.getLogger(__name__)

# not the relaying peer's fault: an honest peer relays a writer it has not caught or proven yet
_BENIGN_REJECTIONS = frozenset({"replay", "equivocation", "banned", "evicted", "superseded", "departed"})
# nor a run config record we refuse (each node decides its admins): skipped, the session goes on
_SKIPPED_IN_SYNC = _BENIGN_REJECTIONS | {"unauthorized"}
_MAX_ANSWERS_PER_PEER = 2  # an honest peer runs one session with us at a time


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ReplicatedState:
    def __init__(
        self,
        host: IHost,
        key_pair: KeyPair,
        *,
        data_dir: Path,
        run_id: str,
        config: StateConfig | None = None,
    ) -> None:
        if not run_id or len(run_id) > 128:
            raise ValueError("run_id must be a non-empty string of at most 128 chars")
        self.config = config or StateConfig()
        self.host = host
        self.run_id = run_id
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        admins = self.config.admins
        self._replica = Replica(
            run_id=run_id, key_pair=key_pair, admins=admins, limits=self.config.limits,
            trusted=self._trusted, admin_relays=None if admins else self.config.anchors,
        )
        self._log = DurableLog(
            state_log_path(Path(data_dir), run_id), compact_min_records=self.config.compact_min_records,
            retained=self._replica.retained,
        )
        self._changed = trio.Event()
        self._generation = 0
        self._snapshot_cache: tuple[int, documents.Snapshot] | None = None
        self._plan = SyncPlan(self.config.plan)
        self._news = News(self.config.plan.news_window_s)  # streams changed lately (``sync_plan``)
        self._wake = trio.Event()  # a change, or a new peer
        self._retry_at: dict[str, float] = {}  # outbound sessions that failed
        self._failures: dict[str, int] = {}  # the failures in a row of each, for the backoff
        self._in_flight: set[str] = set()  # peers in a session we started
        self._penalized_until: dict[str, float] = {}  # peers that sent bad input
        self._heartbeat, self._renewed_at = 0, -math.inf  # our lease's counter; when (trio time) it was renewed
        self._proven = ProvenPeers(lease_s=self.config.lease.lease)
        self._vouched: list[str] | None = None  # the proven peers our record lists
        self._verified_cache: tuple[tuple[int, int], set[str]] | None = None  # see ``_trusted``
        self._left = False
        self._nursery: trio.Nursery | None = None
        self.serving = ServingBudget(self.config.serving)
        self._answers = AnswerSlots(self.serving, per_peer=_MAX_ANSWERS_PER_PEER)

    # -- service -------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._open_log()
        self.host.set_stream_handler(sync.SYNC_PROTOCOL, self._handle_stream)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.heartbeat()
                nursery.start_soon(self._heartbeat_loop)
                nursery.start_soon(self._sync_loop)
                nursery.start_soon(self._log.retry_held_records)
                task_status.started()
        finally:
            # The handler stays registered: py-libp2p 0.8.1 raises KeyError inside the swarm (taking the host
            # down) if a handler is removed while a stream negotiates it. With no nursery it resets every stream.
            self._nursery = None
            await self._log.close()

    async def _open_log(self) -> None:
        self._replica.tick(time.monotonic())
        records = await self._log.open()
        for record in records:
            try:
                # relayed by ourselves: the run config we accepted before is accepted again
                self._replica.receive_wire(record, from_peer=self.peer_id)
            except RejectedUpdate as exc:
                if exc.reason not in _BENIGN_REJECTIONS:
                    log.warning("state log %s: skipped a record: %s", self._log.path, exc)
        self._replica.take_new_evidence()  # it came from the log
        self._replica.hold_own_streams()
        if not (self.config.admins or self.config.anchors or self._replica.admins):
            self._replica.adopt_admin(self.peer_id)  # no admin known, joined through nobody: a new run
        member = self._replica.snapshot()["members"].get(self.peer_id)
        self._heartbeat = member["heartbeat"] if member else 0
        self._bump()

    # -- writes (our own documents) -------------------------------------------------------------

    async def update_member(self, **fields: object) -> None:
        """Set fields of our membership record: addrs, device, throughput, reachability, role."""
        documents.validate_member_fields(fields)
        await self._write(self.peer_id, lambda doc: documents.write_member(doc, fields))

    async def heartbeat(self) -> None:
        """Renew our lease now (also done automatically); clears a previous ``leave()``."""
        self._left = False
        await self._write(self.peer_id, lambda doc: None)

    def _renewing(self, mutate: Callable[[Doc[Map[object]]], None]) -> Callable[[Doc[Map[object]]], None]:
        """``mutate`` and a renewal of our lease (our vouches too, if changed) in one envelope (``LeasePolicy``)."""
        self._heartbeat += 1
        interval, lease = self.heartbeat_interval(), self.config.lease
        self._proven.lease_s, now = lease.scaled_lease(interval), trio.current_time()
        expires, beat = lease.lease_expiry_ms(_now_ms(), interval), self._heartbeat
        vouched = sorted(self.proven_peers())[:MAX_VOUCHES]
        vouches, self._vouched = vouched if vouched != self._vouched else None, vouched

        def renewed(doc: Doc[Map[object]]) -> None:
            mutate(doc)
            documents.write_lease(doc, lease_expires_ms=expires, heartbeat=beat, vouches=vouches)
            self._renewed_at = now  # written (a write that raised renews nothing)

        return renewed

    def heartbeat_interval(self) -> float:
        """How often we renew our lease now: the slower the more members (``LeasePolicy``)."""
        return self.config.lease.interval_for(present(self.snapshot()["members"]))

    async def leave(self) -> None:
        """Mark ourselves as left and push that to every connected peer (bounded by sync_timeout)."""
        self._left, self._heartbeat = True, self._heartbeat + 1
        await self._write(self.peer_id, partial(documents.write_lease, lease_expires_ms=0, heartbeat=self._heartbeat,
                                                left=True))
        await self.flush()

    async def set_progress(self, round: int, weights_hash: str) -> None:
        await self._write(self.peer_id, partial(documents.write_progress, round=round, weights_hash=weights_hash))

    async def set_run_config(self, config: Mapping[str, object]) -> None:
        """Replace the run config (admins only; raises ``LocalProtocolError`` otherwise)."""
        if self.peer_id not in self._replica.admins:
            raise LocalProtocolError("only admin keys may change the run config")
        await self._write(documents.CONFIG_DOC, lambda doc: documents.write_config(doc, config))

    async def add_checkpoint(self, round: int, hashes: list[str], holder: str | None = None) -> None:
        holder = holder or self.peer_id
        await self._write(self.peer_id, partial(documents.write_checkpoint, round=round, hashes=hashes, holder=holder))

    async def set_expert_owner(self, expert: str, owned: bool = True) -> None:
        await self._write(self.peer_id, lambda doc: documents.write_expert(doc, expert=expert, owned=owned))

    async def set_owned_experts(self, experts: list[str]) -> None:
        """Replace the set of experts this node owns (SPES) in one write."""
        await self._write(self.peer_id, lambda doc: documents.write_owned_experts(doc, experts))

    async def _write(self, doc_name: str, mutate: Callable[[Doc[Map[object]]], None]) -> None:
        if not self._log.started:
            raise LocalProtocolError("ReplicatedState.run() has not started")
        if doc_name == self.peer_id and not self._left:
            mutate = self._renewing(mutate)
        envelopes = await self._log.write(lambda: self._replica.local_write(doc_name, mutate))
        if envelopes:
            self._bump(envelopes)

    async def _settle_own_streams(self) -> None:
        """After a completed sync session: publish our own streams (see "Our own history")."""
        if not self._replica.holding:
            return
        try:
            snapshots = await self._log.write(self._replica.settle)
            self._news.note((env.stream for env in snapshots), trio.current_time())
        except LocalProtocolError as exc:  # a document past the snapshot cap: stays unpublished
            log.warning("state: cannot publish this node's own entries: %s", exc)
            return
        for env in snapshots:
            log.warning(
                "state: the swarm held entries of this node from an earlier run of its data dir "
                "(a restored copy?): superseded them with seq %d of %r", env.seq, env.doc,
            )
        self._bump()

    # -- reads -----------------------------------------------------------------------------------

    def snapshot(self) -> documents.Snapshot:
        """The replicated state as JSON-able data: members, progress, config, checkpoints, experts."""
        if self._snapshot_cache is None or self._snapshot_cache[0] != self._generation:
            self._snapshot_cache = (self._generation, self._replica.snapshot())
        return self._snapshot_cache[1]

    def live_members(self, now_ms: int | None = None) -> list[str]:
        """Verified members (see ``verified``) whose lease covers ``now_ms``."""
        when = _now_ms() if now_ms is None else now_ms
        return live_members(self.snapshot()["members"], now_ms=when, verified=self.verified(), **self._lease_margins())

    def verified(self) -> set[str]:
        """Writers that count as members for us: ourselves, peers that proved themselves to us
        on a live connection, and peers enough of those vouch for (``liveness.verified_writers``)."""
        return verified_writers(
            self.snapshot()["members"], me=self.peer_id, proven=self.proofs(), now_ms=_now_ms(),
            admins=self._replica.admins, newcomer=len(self._proven) <= 1, policy=self.config.vouching,
            **self._lease_margins(),
        )

    def unverified_claims(self) -> list[str]:
        """Writers whose record claims a lease (however long) but who are not verified."""
        members, now, verified = self.snapshot()["members"], _now_ms(), self.verified()
        return sorted(peer for peer, record in members.items() if peer not in verified and is_live(record, now_ms=now))

    def proven_peers(self) -> set[str]:
        """Peers with a completed sync session within the last lease."""
        return self._proven.current(time.monotonic())

    def proofs(self) -> dict[str, Proof]:
        """The proven peers with the network origin of their connection and their standing."""
        return self._proven.proofs(time.monotonic())

    def _lease_margins(self) -> dict[str, int]:
        lease = self.config.lease
        return {"clock_skew_ms": int(lease.clock_skew * 1000), "max_ahead_ms": lease.max_ahead_ms}

    def _trusted(self, writer: str) -> bool:
        """Never evicted from a full table: peers that proved themselves to us (in this run of the process)
        or that our members vouch for. Asked for writer after writer while a batch fills the table: the
        verified set is computed once per state generation and second."""
        if writer in self._proven:
            return True
        key = (self._generation, int(time.monotonic()))
        if self._verified_cache is None or self._verified_cache[0] != key:
            self._verified_cache = (key, self.verified())
        return writer in self._verified_cache[1]

    def _mark_proven(self, peer: str, stream: INetStream) -> None:
        if self._proven.mark(peer, sync.observed_origin(stream), time.monotonic()):  # others may wait for our word
            self._spawn(self._refresh_vouches)

    async def _refresh_vouches(self) -> None:
        if not self._left and sorted(self.proven_peers())[:MAX_VOUCHES] != self._vouched:
            await self._write(self.peer_id, lambda doc: None)  # the renewal writes them

    @property
    def admins(self) -> frozenset[str]:
        """Who may write the run config, as this node sees it now (``StateConfig``)."""
        return self._replica.admins

    def counters(self) -> dict[str, int | dict[str, int]]:
        return {**self._replica.counters(), "log_bytes": self._log.size_bytes, "log_held_records": self._log.held,
                "sync_answers_busy": self.serving.busy, "sync_answer_bytes": self.serving.served_bytes}

    @property
    def log_failing(self) -> str | None:
        """Why the state log cannot be written now (a full disk), or None."""
        return self._log.failing

    def dump(self) -> dict[str, object]:
        """What ``lattica state --json`` prints: the snapshot plus this node's local view."""
        return {
            **self.snapshot(),
            "live": self.live_members(),
            "unverified": self.unverified_claims(),
            "proven": {
                peer: {"origin": proof.origin, "standing_s": round(proof.standing_s, 1)}
                for peer, proof in sorted(self.proofs().items())
            },
            "banned": self._replica.banned(),
            "node": {"peer_id": self.peer_id, "run_id": self.run_id, **self.counters()},
        }

    @property
    def generation(self) -> int:
        return self._generation

    async def wait_changed(self) -> None:
        """Return at the next change of the state (local or remote)."""
        await self._changed.wait()

    def _bump(self, envelopes: Iterable[Envelope] = ()) -> None:
        """The state changed (``envelopes``: those applied, news to push)."""
        self._news.note((env.stream for env in envelopes), trio.current_time())
        self._generation += 1
        self._changed.set()
        self._changed = trio.Event()
        self._wake.set()

    # -- SyncEndpoint ----------------------------------------------------------------------------

    def state_vector(self) -> list[list[str | int]]:
        return self._replica.state_vector()

    def writers(self) -> set[str]:
        return self._replica.writers() | set(self._replica.banned())

    def missing_for(self, vector: object) -> list[Envelope]:
        return self._log.only_durable(self._replica.missing_for(vector))

    async def accept_batch(self, wire_envelopes: list[object], *, from_peer: str) -> None:
        applied: list[Envelope] = []
        failure: RejectedUpdate | None = None
        for raw in wire_envelopes:
            try:
                applied.extend(self._replica.receive_wire(raw, from_peer=from_peer))
            except RejectedUpdate as exc:
                if exc.reason not in _SKIPPED_IN_SYNC:
                    failure = failure or exc
                elif exc.reason == "unauthorized":
                    log.debug("state sync: skipped a record from %s: %s", from_peer, exc)
        evidence = self._replica.take_new_evidence()
        if evidence:
            log.warning("state sync: banned %s: signed two different histories", evidence[0].writer)
        if applied or evidence:
            await self._log.append(applied + evidence)
            self._bump(applied)
        if failure is not None:
            raise failure

    # -- peers -----------------------------------------------------------------------------------

    def notify_peer_connected(self, peer_id: ID | str) -> None:
        """A new peer: a node that has not synced yet starts with it now rather than later."""
        self._wake.set()

    async def flush(self) -> None:
        """A push of our news to every connected peer at once, within sync_timeout (two full sessions while held)."""
        with trio.move_on_after(self.config.sync_timeout):
            for _ in range(2 if self._replica.holding else 1):
                async with trio.open_nursery() as nursery:
                    for peer in self._sync_peers(now=None):
                        nursery.start_soon(self._sync_once_quietly, Session(peer, self._replica.holding))

    def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> bool:
        """Start ``fn`` in the service's nursery; False once it is closing (a handler may run after it closed)."""
        if self._nursery is None:
            return False
        try:
            self._nursery.start_soon(fn, *args)
        except RuntimeError:  # "Nursery is closed to new arrivals"
            return False
        return True

    def _sync_peers(self, now: float | None) -> list[str]:
        """Connected peers that serve state sync (at ``now``: neither in a session we started nor backed off)."""
        peers = [p.to_base58() for p in self.host.get_connected_peers()]
        return [p for p in peers if p != self.peer_id and sync.serves_sync(self.host, p) and (now is None or (
            p not in self._in_flight and now >= max(self._retry_at.get(p, 0.0), self._penalized_until.get(p, 0.0))))]

    async def _sync_loop(self) -> None:
        """Sessions as ``SyncPlan`` plans: a small swarm's at once at each change (``_eager_sessions``), a
        larger one's in waves at a change or else every ``sync_interval``, at most one wave per."""
        synced_generation, last_wave = -1, -math.inf
        while True:
            now, period = trio.current_time(), self.config.sync_interval
            self._replica.tick(time.monotonic())
            peers = self._sync_peers(now=None)
            if self._plan.eager(peers):
                wake_at = self._eager_sessions(peers, now)
            elif now >= last_wave + (period if synced_generation != self._generation else 2 * period):
                last_wave, synced_generation = now, self._generation
                ready, holding = self._sync_peers(now), self._replica.holding
                for session in self._plan.due(ready, now, news=bool(self._news.keys(now)), holding=holding,
                                              refresh=self._proven.aging(ready, time.monotonic())):  # proofs kept fresh
                    self._spawn(self._sync_once_quietly, session)  # a slow peer does not hold up the next wave
                wake_at = now + period
            else:
                wake_at = last_wave + (period if synced_generation != self._generation else 2 * period)
            self._wake = trio.Event()  # set by a change, a new peer or a finished session
            with trio.move_on_at(min(wake_at, now + self.config.peer_poll_interval)):
                await self._wake.wait()

    def _eager_sessions(self, peers: list[str], now: float) -> float:
        """Start a small swarm's due sessions (``SyncPlan.eager_due``); when the next falls due
        (a session that ends wakes the loop before)."""
        generation, period, ready = self._generation, self.config.sync_interval, self._sync_peers(now)
        started = set()
        for session in self._plan.eager_due(peers, ready, now, generation=generation, period=period):
            if self._spawn(self._sync_once_quietly, session, generation):
                started.add(session.peer)
        idle = [p for p in ready if p not in started]
        backed_off = [max(self._retry_at.get(p, 0.0), self._penalized_until.get(p, 0.0))
                      for p in peers if p not in ready and p not in self._in_flight]
        return min([self._plan.next_eager_at(idle, generation=generation, period=period), *backed_off])

    async def _sync_once_quietly(self, session: Session, generation: int | None = None) -> bool:
        """One initiated session (of a small swarm's, started at ``generation``); errors are logged,
        the peer backed off, and False returned."""
        peer = session.peer
        self._in_flight.add(peer)
        try:
            news = None if session.full else self._news.keys(trio.current_time()) if session.news else set()
            with trio.fail_after(self.config.sync_timeout):
                stream = await self.host.new_stream(ID.from_base58(peer), [sync.SYNC_PROTOCOL])
                try:
                    await sync.initiate(stream, self, peer_id=peer, news=news)
                finally:
                    await close_quietly(stream)
            self._mark_proven(peer, stream)
            self._plan.completed(Session(peer, news is None))
            if generation is not None:
                self._plan.synced(peer, generation=generation, now=trio.current_time())
            self._failures.pop(peer, None)
            await self._settle_own_streams()
        except RemoteProtocolError as exc:
            log.warning("state sync: dropping bad input from %s: %s", peer, exc)
            self._penalized_until[peer] = trio.current_time() + self.config.max_backoff
        except (RemoteError, trio.TooSlowError) as exc:
            log.debug("state sync with %s failed: %s", peer, exc)
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds when a stream cannot be opened
            log.debug("state sync with %s could not start: %r", peer, exc)
        else:
            return True
        finally:
            self._in_flight.discard(peer)
            self._wake.set()  # a small swarm's peer may be due again
        self._failures[peer] = failures = self._failures.get(peer, 0) + 1
        self._retry_at[peer] = trio.current_time() + min(self.config.max_backoff, 0.25 * 2**failures)
        return False

    async def _handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self._nursery is None or trio.current_time() < self._penalized_until.get(peer, 0.0):
            await reset_quietly(stream)
            return
        if not self._answers.start(peer, trio.current_time()):
            with contextlib.suppress(BrokenError):
                await sync.refuse_busy(stream, peer_id=peer)
            await close_quietly(stream)
            return
        try:
            with trio.fail_after(self.config.sync_timeout):
                answered = await sync.respond(stream, self, peer_id=peer,
                                              take=lambda n: self._answers.take(n, trio.current_time()))
            if answered:
                self._mark_proven(peer, stream)
                await self._settle_own_streams()
        except RemoteProtocolError as exc:
            log.warning("state sync: dropping bad input from %s: %s", peer, exc)
            self._penalized_until[peer] = trio.current_time() + self.config.max_backoff
            await reset_quietly(stream)
        except (BrokenError, RemoteError, trio.TooSlowError) as exc:
            log.debug("state sync from %s failed: %s", peer, exc)
            await reset_quietly(stream)
        finally:
            self._answers.end(peer)
            await close_quietly(stream)

    async def _heartbeat_loop(self) -> None:
        """A renewal when none was written for an interval (another write of our record renews too)."""
        while True:
            now, interval = trio.current_time(), self.heartbeat_interval()
            await trio.sleep_until(now + interval if self._left else max(self._renewed_at + interval, now))
            if not self._left and trio.current_time() >= self._renewed_at + self.heartbeat_interval():
                await self.heartbeat()
            after_ms = int(self.config.forget_departed_after_s * 1000)  # members long gone are dropped
            if self._replica.forget_departed(self.snapshot()["members"], now_ms=_now_ms(), after_ms=after_ms):
                self._bump()  # the log drops them at its next rewrite

