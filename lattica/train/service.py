"""Training inside the daemon: the trainer, the data plane and the run state wired together.

Theory of operation: ``TrainingService.run`` starts the tensor data plane and the round
coordinator, then (in the background) waits until ``min_peers`` members are live, builds the
task and the outer strategy, and either resumes from its own last checkpoint or — when the run
is already past round 0 — fetches the agreed outer state from several holders (hash-verified)
and trains from the next round. After each completed round it publishes ``(round, weights
hash)`` in the replicated state and serves its outer state for joiners. A peer whose round ran
without the others (it was late, or the all-reduce failed) catches up the same way a joiner
does, before its next inner step, so replicas re-converge to bit-identical outer weights; if no
newer state came meanwhile, it publishes its own (a peer a round behind it adopts that, and the
two share rounds again). A trainer stays a round candidate while it fetches mid-run.

Churn: a member is ``joining`` until it can sync; once the run is past its first round a joining
member is not a round candidate, so coordinators never wait for a peer that is still loading or
fetching after a restart; ``min_peers`` only gates the start of a run.
Syncs go through a stall guard (a silent member aborts the sync after a round deadline).
Which state to adopt is the one most live peers hold (``outer_transfer.repair_target``, with
our own hash history kept in the checkpoints); after the last round the service keeps
repairing, so every replica ends on the same state. Adopted states are checkpointed at once.
Live members are the replicated state's verified writers (records of keys that never connected
do not count), and a published (round, hash) that no holder serves is distrusted
(``membership.UnservableClaims``): it starts no run without ``min_peers``, marks nobody as
behind, and is offered for adoption again only after a back-off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from typing import Any

import trio
from trio_typing import TaskStatus

from lattica.config import TrainSettings
from lattica.errors import LatticaError
from lattica.train.membership import RecentTrainers, UnservableClaims
from lattica.train.outer_transfer import ProbedManifests
from lattica.train.run_config import agree_run_config

log = logging.getLogger(__name__)

_CATCH_UP_WAIT_S = 5.0  # after a round run alone: the others' result of it is on its way
# after a skipped round: the members of the failed attempt skipped it too (a collective fails for
# all its members), so only a peer in another group may have completed it; waiting long for that
# holds up a whole swarm whose round failed
_SKIPPED_WAIT_S = 1.0
_JOIN_ATTEMPTS = 3
_REPAIR_RETRY_S = 2.0
_HISTORY_ROUNDS = 64  # own outer-state hashes remembered per round (see ``repair_target``)
_JOINING, _TRAINER, _DONE = "joining", "trainer", "done"  # member roles
_SILENT_BEATS = 3.5  # heartbeat intervals without a lease renewal: unresponsive
_SETTLE_BEATS = 3.0  # heartbeat intervals a peer seen silent must be heard before it is again
_VANISHED_S = 60.0  # a connected trainer whose lease ran out (a cut link) still counts this long
_PROBE_TIMEOUT_S = 10.0  # asking a holder for the manifest of the state it published


class TrainingService:
    def __init__(self, node: Any, state: Any, settings: TrainSettings) -> None:
        self.node = node
        self.state = state
        self.settings = settings
        self.peer_id = node.peer_id.to_base58()
        self.phase = "starting"
        self.progress: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None
        self.tensors: Any = None
        self.trainer: Any = None
        self.strategy: Any = None
        self._nursery: trio.Nursery | None = None
        self._bytes_sent = 0
        self._rounds_done = 0
        self._mine: tuple[int, str | None] = (0, None)  # completed rounds, outer state hash
        self._history: dict[int, str] = {}  # our outer-state hash of recent rounds, on one line
        self._catch_up_owed: float | None = None  # how long to wait for the others' state
        self._next_repair_at = 0.0
        self._served: Any = None  # ServedRounds, once the data plane runs
        self._beats: dict[str, tuple[Any, float]] = {}  # peer -> (heartbeat, when it last changed)
        self._back_at: dict[str, float] = {}  # peer seen silent -> last time it was (settling)
        self._recent = RecentTrainers(peer_id=self.peer_id, memory_s=_VANISHED_S)
        self._unservable = UnservableClaims()  # (round, hash) claims no holder could serve
        self._probed = ProbedManifests()  # manifests fetched by ``_servable``, for the fetch after it
        self.groups: Any = None  # GossipGroups for NoLoCo and gossip averaging (no coordinator)

    # -- service -------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
        from lattica.coordination.rounds import RoundCoordinator
        from lattica.train.strategy_settings import contribution_screen

        host = self.node.host
        screen = contribution_screen(self.settings)
        self.tensors = TensorService(host, self.node.key_pair, config=TensorServiceConfig(screen=screen))
        self.coordinator = RoundCoordinator(
            host,
            peer_id=self.peer_id,
            run_id=self.node.config.run_id,
            candidates=self._candidates,
            deadline_s=self.settings.round_deadline_s,
            responsive=self._responsive,
            published_round=self._published_round,
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.tensors.run)
            await nursery.start(self.coordinator.run)
            task_status.started()
            nursery.start_soon(self._watch_members)
            nursery.start_soon(self._train_guarded)

    async def _watch_members(self) -> None:
        """Keep ``RecentTrainers`` current from the start, not only at round ends: a peer
        restarted just before its link is cut must remember who trained before the cut, or its
        first round, run cut off, looks like a round of the whole run (published, and followed
        by more at once). And look at every member's heartbeat twice per interval: a change is
        timed when it is seen, and one seen late makes a silent member look alive for longer."""
        while True:
            self._others_train()
            for peer in self.state.live_members():
                if peer != self.peer_id:
                    self._heard(peer)  # a heartbeat's change is timed when we look
            await trio.sleep(0.5)

    def _candidates(self) -> list[str]:
        """The candidates of a round: live trainers ready to sync. Before the first round is
        published, also those still loading: at the start of a run everyone is waited for."""
        if self._agreed() is None:
            return self._live_with_role(_JOINING, _TRAINER)
        return self._live_with_role(_TRAINER)

    def _responsive(self, peer: str) -> bool:
        """Connected, and its lease renewals (one per heartbeat interval) still arrive: a peer
        whose link was cut silently keeps its connection and its lease for seconds, but its
        heartbeat stops moving at once. A peer seen silent is not responsive again until it has
        been heard for a few intervals: back from a cut or a restart it first catches up, and
        rounds should not wait for that — unless it is not behind us."""
        if not self._alive(peer):
            return False
        back = self._back_at.get(peer)
        interval = self.state.config.lease.heartbeat_interval
        return back is None or time.monotonic() - back >= _SETTLE_BEATS * interval or self._not_behind(peer)

    def _alive(self, peer: str) -> bool:
        """Connected, and its lease renewals still arrive (see ``_responsive``)."""
        connected = any(p.to_base58() == peer for p in self.node.host.get_connected_peers())
        if connected and self._heard(peer):
            return True
        self._back_at[peer] = time.monotonic()  # silent: when heard again, it settles first
        return False

    def _heard(self, peer: str) -> bool:
        """Its lease renewals (one per heartbeat interval) still arrive, through whichever peer
        relays the state: a member cut off or killed stops renewing for everyone, whereas one
        we have just not dialled yet is still heard."""
        now, interval = time.monotonic(), self.state.config.lease.heartbeat_interval
        beat = (self.state.snapshot().get("members", {}).get(peer) or {}).get("heartbeat")
        seen = self._beats.get(peer)
        if seen is None or seen[0] != beat:
            self._beats[peer] = seen = (beat, now)
        return now - seen[1] < _SILENT_BEATS * interval

    def _progress(self) -> dict[str, Any]:
        """The published (round, hash) records that may be adopted: a claim that no holder
        could serve when we tried is offered again only after a back-off (a member can claim any
        round: it must not make us fetch in a loop; ``_published_round`` ignores it until served)."""
        return self._unservable.trusted_progress(self.state.snapshot().get("progress", {}), time.monotonic())

    def _published_round(self, peer: str) -> int | None:
        record = self.state.snapshot().get("progress", {}).get(peer) or {}
        rnd = record.get("round")
        if type(rnd) is not int or self._unservable.distrusted((rnd, record.get("weights_hash"))):
            return None
        return rnd

    def _not_behind(self, peer: str) -> bool:
        """Whether ``peer`` published at least the rounds we completed: it needs no catching up.
        Seen from a peer whose own link was cut, every other peer went silent and comes back;
        they are ahead of it, and it must not take them for stragglers (it would seal rounds
        without them, alone)."""
        rnd = self._published_round(peer)
        return rnd is not None and rnd >= self._mine[0] > 0

    def _live_with_role(self, *roles: str) -> list[str]:
        members = self.state.snapshot().get("members", {})
        return [p for p in self.state.live_members() if members.get(p, {}).get("role") in roles]

    async def _train_guarded(self) -> None:
        try:
            await self._train()
        except LatticaError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)
        except ValueError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)
        except Exception as exc:  # a training bug must not take the node off the network
            self.phase, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("training failed")

    async def _train(self) -> None:
        self.phase = "waiting for peers"
        # "joining" until we can sync: round coordinators do not wait for a peer that is still
        # loading, resuming or fetching (after a restart that takes seconds)
        await self.state.update_member(role=_JOINING)
        # ``min_peers`` gates the start of a run; a peer (re)joining a run that is already past
        # round 0 trains with whoever is live, or a restart after a crash could wait forever
        await self._wait_for_peers_or_a_running_swarm()
        # the run config an admin published wins over ours (``run_config.py``)
        self.phase = "agreeing on the run config"
        self.settings = await agree_run_config(
            self.state, self.settings, admins=tuple(self.state.config.admins), wait_s=self.settings.round_deadline_s
        )
        if self._gossips():
            await self._start_gossip_groups()
        self.phase = "loading"
        ownership = self._expert_ownership()
        trainer = await trio.to_thread.run_sync(self._build_trainer, ownership)
        self.trainer = trainer
        await self.state.update_member(device=trainer.device.describe())
        if await trio.to_thread.run_sync(trainer.resume):
            saved = trainer.annotations.get("outer_history", {})
            if isinstance(saved, dict):
                self._history = {int(r): h for r, h in saved.items() if isinstance(h, str)}
            self._remember(self.strategy.completed_rounds, self._outer_hash())
        # a fresh peer, or one restarted from a checkpoint the swarm has moved past, takes the
        # swarm's outer state; otherwise it trains on from its own checkpoint
        if self.strategy.replicas_agree or self._gossips():
            # a joiner, or a peer restarted from a stale checkpoint, takes the swarm's state —
            # with gossip, where replicas differ, the newest published replica (one holder,
            # hash-verified); eager DiLoCo starts from its own
            await self._join_running_swarm()
        if self.strategy.replicas_agree:
            self._wrap_strategy_for_catch_up()
        elif self._gossips():
            self._wrap_strategy_to_keep_up()
        await self.state.update_member(role=_TRAINER)
        if ownership is not None:
            await ownership.publish()
        self.phase = "training"
        summary = await trainer.run()
        self.summary = dataclasses.asdict(summary)
        self.phase = "done"
        log.info("training finished: %s", self.summary)
        await self.state.update_member(role=_DONE)  # no longer a round candidate
        if self.strategy.replicas_agree:
            await self._settle()

    async def _wait_for_peers_or_a_running_swarm(self) -> None:
        """Until ``min_peers`` members are live, or the run is past round 0: some holder serves
        the state the others published (a claimed round that nobody serves is no run)."""
        while len(self._live_with_role(_JOINING, _TRAINER)) < self.settings.min_peers:
            agreed = self._agreed()
            if agreed is not None and await self._servable(agreed):
                return
            with trio.move_on_after(1.0):
                await self.state.wait_changed()

    async def _servable(self, agreed: tuple[int, str, list[str]]) -> bool:
        """Whether a holder of ``agreed`` serves its manifest; if none does, the claim is
        distrusted (see ``membership.UnservableClaims``)."""
        from lattica.train.join import MANIFEST, read_manifest
        from lattica.train.outer_transfer import fetch_of_round

        rnd, digest, holders = agreed
        fetch = fetch_of_round(self.tensors.fetch, rnd)
        for holder in holders:
            try:
                with trio.fail_after(_PROBE_TIMEOUT_S):
                    manifest = await fetch(holder, [MANIFEST])
                    read_manifest(manifest, peer_id=holder)
                self._probed.keep(holder, rnd, manifest)
                return True
            except (LatticaError, trio.TooSlowError) as exc:
                log.debug("holder %s does not serve round %d: %s", holder, rnd, exc)
        period = self._unservable.failed((rnd, digest), time.monotonic())
        log.warning("no holder serves the published state of round %d; ignoring that claim for %.0f s", rnd, period)
        return False

    async def _settle(self) -> None:
        """After the last round, keep taking the run's final state while the node is up: a
        replica whose last round failed, ran alone or ran cut off ends identical to the others.
        A final round run alone is published too: two replicas that each finished on their own
        would otherwise each see the other's older claim and neither would ever adopt; with
        both final states published, ``repair_target``'s tie-break picks the same one for both."""
        await self._publish_if_unpublished()
        while True:
            if await self._repair_if_diverged():
                # the weights are now the adopted state's: the summary's val loss must be its
                # (not that of the lone or skipped last round it replaced)
                await self.trainer.revalidate()  # reports through _on_progress
                self.summary = dataclasses.asdict(self.trainer.summary())
            with trio.move_on_after(1.0):
                await self.state.wait_changed()

    def _expert_ownership(self) -> Any:
        """SPES: expert ownership kept in the replicated state (None for other strategies)."""
        if self.settings.strategy != "spes" or self.settings.task:
            return None
        from lattica.train.moe import MOE_PRESETS
        from lattica.train.ownership import ReplicatedOwnership

        return ReplicatedOwnership(
            self.state, peer_id=self.peer_id, candidates=self._candidates,
            num_experts=MOE_PRESETS[_moe_preset(self.settings.model)].num_experts,
        )

    def _build_trainer(self, ownership: Any = None) -> Any:
        from lattica.train.checkpoint import CheckpointStore
        from lattica.train.collective import StallGuardedCollective
        from lattica.train.data import DataConfig
        from lattica.train.device import select_device
        from lattica.train.schedule import ScheduleConfig
        from lattica.train.strategies import strategy_class
        from lattica.train.strategy_settings import strategy_config
        from lattica.train.task import TaskContext, builtin_task, load_task
        from lattica.train.trainer import Trainer, TrainerConfig

        s = self.settings
        # identical initial weights everywhere (model seed), different data order per peer
        data_seed = s.seed * 1_000_003 + zlib.crc32(self.peer_id.encode())
        context = TaskContext(seed=data_seed)
        if s.task:
            task = load_task(s.task, context)
        else:
            task = builtin_task(
                model=_model_config(s), data=DataConfig(source=s.data), batch_size=s.batch_size,
                context=context, model_seed=s.seed,
            )
        if s.strategy == "spes" and not s.task:
            from lattica.train.moe import build_moe_model

            task.model = build_moe_model(_moe_preset(s.model), seed=s.seed)
        # a member that goes silent inside a sync (link cut, frozen) breaks no connection: the
        # guard aborts a sync whose data plane received nothing for a round deadline
        collective = StallGuardedCollective(
            self.tensors, progress=self.tensors.stats.total_received, stall_s=s.round_deadline_s,
            alive=self._heard,
        )
        cls = strategy_class(s.strategy)
        extra = {} if ownership is None else {"ownership": ownership}
        strategy = cls(  # type: ignore[call-arg]
            task.model, collective=collective, groups=self.groups or self.coordinator,
            config=strategy_config(s, members=tuple(sorted(self._live_with_role(_JOINING, _TRAINER)))),
            **extra,
        )
        self.strategy = strategy
        total = s.rounds * s.inner_steps
        trainer_config = TrainerConfig(
            total_steps=total,
            schedule=ScheduleConfig(lr=s.inner_lr, warmup_steps=min(s.warmup_steps, total - 1), total_steps=total),
            eval_every=s.inner_steps,
            log_every=max(1, min(10, s.inner_steps // 2)),
        )
        return Trainer(
            task, strategy, trainer_config,
            device=select_device(s.device),
            checkpoints=CheckpointStore(self.node.config.data_dir / "checkpoints", keep=s.keep_checkpoints),
            on_progress=self._on_progress,
            on_round=self._on_round,
        )

    # -- joining and catching up ---------------------------------------------------------------

    async def _join_running_swarm(self) -> bool:
        # the holders move on every round and a fetch that straddles one fails its hash check:
        # look at the state again and retry
        for _ in range(_JOIN_ATTEMPTS):
            agreed = self._agreed()
            if agreed is None or agreed[0] <= self.strategy.completed_rounds:
                return False
            self.phase = "fetching outer state"
            if await self._adopt(agreed):
                await self._publish_round()  # a holder now, and counted at that round
                return True
        return False

    def _agreed(self) -> tuple[int, str, list[str]] | None:
        from lattica.train.outer_transfer import agreed_round

        return agreed_round(self._progress(), self.state.live_members(), self.peer_id)

    async def _adopt(self, agreed: tuple[int, str, list[str]]) -> bool:
        from lattica.train.join import fetch_outer_state, unflatten_outer_state

        rnd, digest, holders = agreed
        started = time.monotonic()
        # a trainer catching up mid-run stays a round candidate while it fetches: the others are
        # in the inner steps of the round after the fetched one, and it asks for that round one
        # fetch after them; a coordinator that did not wait would make it run that round alone
        # too, and then the next (two trainers a round apart never met again)
        try:
            with trio.fail_after(max(30.0, self.settings.round_deadline_s)):
                fetch = self._probed.round_fetch(self.tensors.fetch, rnd)
                flat = await fetch_outer_state(holders, fetch, expected_hash=digest)
            outer = unflatten_outer_state(flat)
        except (LatticaError, trio.TooSlowError) as exc:
            period = self._unservable.failed((rnd, digest), time.monotonic())
            log.warning("could not fetch outer state of round %d: %s; ignoring that claim for %.0f s", rnd, exc, period)
            return False
        self._unservable.served((rnd, digest))
        self.trainer.adopt_outer_state(outer, step=int(outer.get("step", rnd * self.settings.inner_steps)))
        self._observe("checkpoint_fetch_seconds", time.monotonic() - started)
        self._history = {self.strategy.completed_rounds: digest}  # rounds past it were another line
        await self._checkpoint_adopted()
        self._remember(self.strategy.completed_rounds, digest)  # reported once durable
        log.info(
            "adopted outer state of round %d from %d holder(s) in %.2f s",
            rnd, len(holders), time.monotonic() - started,
        )
        return True

    async def _checkpoint_adopted(self) -> None:
        """Make an adopted state durable at once, and drop our checkpoints past it: after a
        restart we resume on the run's line, not on rounds it did not keep."""
        trainer = self.trainer
        store = trainer.checkpoints
        if store is None:
            return
        trainer.annotations["outer_history"] = dict(self._history)
        state, step = trainer.state_dict(), trainer.step
        await trio.to_thread.run_sync(store.save, step, state)
        await trio.to_thread.run_sync(store.discard_after, step)

    def _remember(self, rnd: int, digest: str | None) -> None:
        self._mine = (rnd, digest)
        if digest is None:
            return
        self._history[rnd] = digest
        for old in sorted(self._history)[:-_HISTORY_ROUNDS]:
            del self._history[old]
        if self.trainer is not None:  # saved with the next checkpoint
            self.trainer.annotations["outer_history"] = dict(self._history)

    def _wrap_strategy_for_catch_up(self) -> None:
        strategy = self.strategy
        original = strategy.after_inner_step

        async def after_inner_step(step: int) -> list[Any]:
            # catching up and repairing run here, before this step's sync and after the trainer
            # checkpointed the previous round: a kill during a fetch never loses a completed round
            adopted = False
            if self._catch_up_owed is not None:
                wait_s, self._catch_up_owed = self._catch_up_owed, None
                adopted = await self._catch_up(wait_s)
                if not adopted:  # nobody has a newer state: ours is the run's newest
                    await self._publish_if_unpublished()
            adopted = await self._repair_if_diverged() or adopted
            if adopted:
                # the trainer now stands at the adopted state's step, whose round already ran:
                # syncing for ``step`` too would run one round more than the steps (and every
                # replica that later adopts our state would inherit that offset)
                return []
            reports = await original(step)
            if any(self._ran_alone(report) for report in reports):
                self._catch_up_owed = _CATCH_UP_WAIT_S
            elif any(report.skipped for report in reports):
                self._catch_up_owed = _SKIPPED_WAIT_S
            return reports

        strategy.after_inner_step = after_inner_step  # type: ignore[method-assign]
        next_sync_step = strategy.next_sync_step

        def next_stop(step: int) -> int | None:
            # the trainer runs the steps up to the next sync in one go: stop at once when owed
            return step + 1 if self._catch_up_owed is not None else next_sync_step(step)

        strategy.next_sync_step = next_stop  # type: ignore[method-assign]

    # -- gossip: groups without a coordinator ---------------------------------------------------

    def _gossips(self) -> bool:
        """NoLoCo and gossip averaging sync inside small groups (``lattica.coordination``)."""
        return self.settings.strategy == "noloco" or self.settings.averaging == "gossip"

    async def _start_gossip_groups(self) -> None:
        """Each peer derives its group from the live trainers it holds and confirms it with its
        group only; a partner whose heartbeat stopped is not asked."""
        from lattica.coordination.gossip import GossipGroups
        from lattica.coordination.groups import GossipGroupsConfig

        assert self._nursery is not None
        self.groups = GossipGroups(
            self.node.host, peer_id=self.peer_id, run_id=self.node.config.run_id,
            members=lambda: self._live_with_role(_TRAINER),
            config=GossipGroupsConfig(group_size=self.settings.group_size, grace_s=self.settings.group_grace_s),
            responsive=self._heard,
        )
        await self._nursery.start(self.groups.run)

    def _wrap_strategy_to_keep_up(self) -> None:
        """Gossip: a replica two or more rounds behind the newest published state (it was frozen,
        cut off, or is slow) adopts that state, as a joiner does. Its partners answer a step they
        have left with "gone": behind, it would average alone for good."""
        strategy = self.strategy
        original = strategy.after_inner_step

        async def after_inner_step(step: int) -> list[Any]:
            if await self._adopt_if_behind():
                return []  # the trainer stands at the adopted state's step (see the catch-up)
            return await original(step)

        strategy.after_inner_step = after_inner_step  # type: ignore[method-assign]

    async def _adopt_if_behind(self) -> bool:
        agreed = self._agreed()
        if agreed is None or agreed[0] < self.strategy.completed_rounds + 2:
            return False
        if time.monotonic() < self._next_repair_at:
            return False
        log.info("%d round(s) behind the newest published replica: adopting it", agreed[0] - self.strategy.completed_rounds)
        if await self._adopt(agreed):
            await self._publish_round()
            return True
        self._next_repair_at = time.monotonic() + _REPAIR_RETRY_S
        return False

    def _ran_alone(self, report: Any) -> bool:
        others = self._others_train()  # looked at every round: the memory must predate a cut
        return not report.skipped and len(report.group) <= 1 and others

    def _others_train(self) -> bool:
        """Whether other trainers take part in the run, counting for a while those whose lease
        ran out while we stay connected (see ``membership.py``: seen from a cut-off peer, every
        lease runs out)."""
        connected = {p.to_base58() for p in self.node.host.get_connected_peers()}
        members = self.state.snapshot().get("members", {})
        self._recent.observe(members, self.state.live_members(), connected, time.monotonic())
        return bool(self._recent.others()) or len(self._candidates()) > 1

    async def _catch_up(self, wait_s: float) -> bool:
        """After a round we skipped or ran alone: wait (briefly) for the others' result of it.
        True when a state was adopted."""
        with trio.move_on_after(wait_s):
            while True:
                agreed = self._agreed()
                if agreed is not None and (agreed[0], agreed[1]) != self._mine and agreed[0] >= self._mine[0]:
                    if await self._adopt(agreed):
                        await self._publish_round()
                        return True
                    return False
                await self.state.wait_changed()
        return False

    async def _repair_if_diverged(self) -> bool:
        """Adopt the state most live peers hold when ours is not on it (see ``repair_target``);
        True when a state was adopted."""
        from lattica.train.outer_transfer import repair_target

        if time.monotonic() < self._next_repair_at:
            return False
        target = repair_target(
            self._progress(), self.state.live_members(), self.peer_id,
            self._mine, self._history,
        )
        if target is None:
            return False
        log.info("outer state differs from the swarm's round %d: adopting it", target[0])
        if await self._adopt(target):
            await self._publish_round()
            return True
        self._next_repair_at = time.monotonic() + _REPAIR_RETRY_S
        return False

    # -- progress ----------------------------------------------------------------------------

    def _on_progress(self, progress: Any) -> None:
        self.progress = {
            "step": progress.step,
            "round": progress.round,
            "loss": round(progress.loss, 4),
            "tokens_per_s": round(progress.tokens_per_s, 1),
            "lr": progress.lr,
            "val_loss": None if progress.val_loss is None else round(progress.val_loss, 4),
        }

    def _observe(self, histogram: str, seconds: float, **labels: str) -> None:
        metrics = getattr(self.node, "metrics", None)
        if metrics is not None:
            metric = getattr(metrics, histogram)
            (metric.labels(**labels) if labels else metric).observe(seconds)

    def _on_round(self, event: Any) -> None:
        self._bytes_sent += event.report.bytes_sent
        if len(event.report.group) > 1:
            op = "exchange" if self._gossips() else "allreduce"
            self._observe("collective_seconds", event.report.seconds, op=op)
        if event.report.skipped:
            log.info("sync %s skipped: %s", event.report.key, event.report.detail)
            return
        log.info(
            "sync %s done with %d member(s) in %.2f s", event.report.key, len(event.report.group),
            event.report.seconds,
        )
        self._rounds_done += 1
        self._remember(self.strategy.completed_rounds, event.state_hash)
        # a round run alone while others train is replaced by theirs (catch-up publishes that);
        # publishing it at once would offer the others a minority state (it is published when
        # nothing of theirs came: ``_publish_if_unpublished``)
        # (where replicas differ by design, every replica's state is its own, and is published)
        if self._nursery is not None and (not self._ran_alone(event.report) or not self.strategy.replicas_agree):
            self._nursery.start_soon(self._publish_round)

    async def _publish_if_unpublished(self) -> None:
        """Publish our last round if it ran alone and nobody's result of it came (see
        ``_catch_up``): a peer a round behind us must see that it is, and adopt our state —
        otherwise each reaches every round after the other sealed it, runs it alone, and the
        two never meet again."""
        if self._published_round(self.peer_id) != self.strategy.completed_rounds:
            await self._publish_round()

    async def _publish_round(self) -> None:
        from lattica.train.join import outer_state_hash
        from lattica.train.outer_transfer import ServedRounds

        outer = self.strategy.outer_state_dict()
        rnd = self.strategy.completed_rounds
        if self._served is None:
            self._served = ServedRounds(self.tensors)
        self._served.publish(rnd, outer)
        digest = outer_state_hash(outer)  # weights and outer optimizer state: what joiners verify
        self._remember(rnd, digest)
        await self.state.set_progress(rnd, digest)

    def _outer_hash(self) -> str:
        from lattica.train.join import outer_state_hash

        return outer_state_hash(self.strategy.outer_state_dict())

    # -- control API ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "phase": self.phase,
            "strategy": self.settings.strategy,
            "replicas_agree": bool(self.strategy is not None and self.strategy.replicas_agree),
            "rounds_target": self.settings.rounds,
            "rounds_completed": self.strategy.completed_rounds if self.strategy is not None else 0,
            "bytes_sent": self._bytes_sent,
            # tensor-plane bytes this node received (syncs and state fetches), as counted on the wire
            "bytes_received": self.tensors.stats.total_received() if self.tensors is not None else 0,
            "device": self.trainer.device.describe() if self.trainer is not None else None,
            **self.progress,
        }
        if self._gossips():
            info["averaging"] = "gossip"
            spread = self.strategy.consensus_distance if self.strategy is not None else None
            if spread is not None:  # replicas' spread: distance to the group's mean / its norm
                info["consensus_distance"] = round(spread, 6)
        if self.error:
            info["error"] = self.error
        if self.summary:
            info["summary"] = self.summary
        return {"training": info}

    def accounting(self) -> dict[str, int]:
        """The strategy's traffic and memory figures (empty before it is built)."""
        figures = getattr(self.strategy, "accounting", None)
        return figures() if figures is not None else {}

    async def handle_control(self, request: Any) -> Any:
        if request.method == "train":
            return self.status()["training"]
        return None


def _model_config(settings: TrainSettings) -> Any:
    """The preset, trained on sequences of ``seq_len`` tokens (at most the preset's context)."""
    from lattica.train.model import preset

    gpt = preset(settings.model)
    return dataclasses.replace(gpt, context=min(settings.seq_len, gpt.context))


def _moe_preset(model: str) -> str:
    from lattica.train.moe import MOE_PRESETS

    return model if model in MOE_PRESETS else "tiny-moe"


def check_settings(settings: TrainSettings) -> None:
    """Fail at start-up, as one line, on settings that cannot run (see ``settings_check``)."""
    from lattica.train.settings_check import check_settings as check

    check(settings)
