"""Training inside the daemon: the trainer, the data plane and the run state wired together.

Theory of operation: ``TrainingService.run`` starts the tensor data plane and the round
coordinator, then (in the background) waits until ``min_peers`` members are live, agrees on the
run config, builds the trainer (``trainer_factory``), and either resumes from its own last
checkpoint or — when the run is already past round 0 — fetches the agreed outer state from
several holders (hash-verified) and trains from the next round. At the start of a run it first
waits (bounded) for the members still loading, so the first round is everyone's. The pieces,
one concern each:

- ``membership.MembershipView``: the replicated state's schema (members, roles, heartbeats,
  published progress, run config, expert claims), read and written in one place;
- ``liveness.PeerLiveness``: who is heard, alive and responsive, and whether a round of one
  was run alone;
- ``outer_sync.OuterStateSync``: join, catch-up, repair and publishing, reaching the strategy
  through a wrapper that implements the strategy interface (``CatchingUpStrategy`` where
  replicas agree, ``KeepingUpStrategy`` where they average in groups and differ);
- ``coordination``: the round coordinator, or coordinator-free groups for a strategy that
  ``averages_in_groups``.

Churn: a member is ``joining`` until it can sync; once the run is past its first round a joining
member is not a round candidate, so coordinators never wait for a peer that is still loading or
fetching after a restart. A member whose training stopped on an error says ``failed`` (its
daemon stays up): nobody waits for it. A full disk is no such error: checkpoints are retried
(``checkpoint_writer``) while training goes on, and ``lattica status`` says they are failing.
``min_peers`` only gates the start of a run (a claimed round that no holder serves starts
none). Syncs go through a stall guard (a silent member aborts the sync after a round deadline).
After the last round the service keeps repairing, so every replica ends on the same state. A
contribution the strategy refuses (``_refused``) counts against its sender in the data plane's
``rejected_contributions``, and with gossip groups the sender is left out of this peer's next
draws; both show in ``lattica status``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import trio
from trio_typing import TaskStatus

from lattica.config import TrainSettings
from lattica.coordination.gossip import GossipGroups
from lattica.coordination.provider import GroupProvider
from lattica.coordination.rounds import RoundCoordinator
from lattica.diagnostics import NodeFacts
from lattica.errors import LatticaError, LocalProtocolError
from lattica.numerics.screen import Rejection
from lattica.train.engine.collective import StallGuardedCollective
from lattica.train.engine.reports import Progress, RoundCompleted
from lattica.train.engine.tokenized import bits_per_byte
from lattica.train.engine.trainer import Trainer
from lattica.train.ports import ControlRequest, DataPlane, NodeHandle, RunState
from lattica.train.settings import trainer_factory
from lattica.train.settings.retune import fixed_knobs, step_and_comm_cpu
from lattica.train.status import GossipFigures, ProgressFigures, TrainingStatus
from lattica.train.strategies.base import OuterStrategy
from lattica.train.swarm.liveness import PeerLiveness
from lattica.train.swarm.membership import (
    DONE_ROLE,
    FAILED_ROLE,
    JOINING_ROLE,
    TRAINER_ROLE,
    MembershipView,
)
from lattica.train.swarm.outer_sync import CatchingUpStrategy, KeepingUpStrategy, OuterStateSync
from lattica.train.swarm.ownership import ReplicatedOwnership
from lattica.train.swarm.run_config import agree_run_config, agree_run_identity
from lattica.train.tuner import RunTuner, measure

log = logging.getLogger(__name__)

START_WAIT_S = 30.0  # at the start of a run: how long members that are still loading are waited for


class TrainingService:
    """The daemon's training (module docstring): a ``NodeService`` that wires the membership
    view, liveness, outer-state sync, the coordinator and the trainer; ``tensors`` is the data
    plane the composition root built for it."""

    name = "training"

    def __init__(self, node: NodeHandle, state: RunState, settings: TrainSettings, *, tensors: DataPlane) -> None:
        self.node, self.settings, self.tensors = node, settings, tensors
        self.peer_id = node.peer_id.to_base58()
        self.view = MembershipView(state, peer_id=self.peer_id)
        self.phase = "starting"
        self.figures: ProgressFigures | None = None  # the last progress record
        self.summary: dict[str, object] | None = None
        self.error: str | None = None
        self.trainer: Trainer | None = None
        self.strategy: OuterStrategy[object] | None = None  # as the trainer sees it (wrapped)
        self.groups: GroupProvider | None = None  # GossipGroups where the strategy averages in groups
        self._begin_groups: Callable[[], None] | None = None  # GossipGroups.begin
        self._gossips = _averages_in_groups(settings)
        self._ownership: ReplicatedOwnership | None = None
        self._nursery: trio.Nursery | None = None
        self._bytes_sent = 0
        self._consensus_distance: float | None = None  # gossip: the last one a round measured
        self.tuner: RunTuner | None = None  # ``tune = true``: the tuned schedule, the admin's tuning
        self._last_group: tuple[str, ...] = ()
        self._round_bps: float | None = None  # the last round with peers: its bytes sent over its wall time
        self._round_bytes = 0  # and its bytes sent
        self.liveness = PeerLiveness(
            self.view, connected=self._connected, candidates=self._candidates, not_behind=self._not_behind,
        )
        self.outer_sync = OuterStateSync(
            self.view, tensors, settings, ran_alone=self.liveness.ran_alone,
            others_in_rounds=self.liveness.others_in_rounds,
            on_fetched=node.metrics.checkpoint_fetch_seconds.observe,
        )
        self.coordinator = RoundCoordinator(
            node.host, peer_id=self.peer_id, run_id=node.config.run_id,
            candidates=self._candidates, deadline_s=settings.round_deadline_s,
            responsive=self.liveness.responsive, published_round=self.outer_sync.published_round,
        )

    # -- service -------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.tensors.run)
            await nursery.start(self.coordinator.run)
            task_status.started()
            nursery.start_soon(self._watch_members)
            nursery.start_soon(self._train_guarded)

    async def _watch_members(self) -> None:
        """Keep the memory of recent trainers current from the start, not only at round ends: a
        peer restarted just before its link is cut must remember who trained before the cut, or
        its first round, run cut off, looks like a round of the whole run (published, and
        followed by more at once). And look at every member's heartbeat twice per interval."""
        while True:
            self.liveness.look()
            await trio.sleep(0.5)

    def _connected(self) -> set[str]:
        return {p.to_base58() for p in self.node.host.get_connected_peers()}

    def _candidates(self) -> list[str]:
        """The candidates of a round: live trainers ready to sync. Before the first round is
        published, also those still loading: at the start of a run everyone is waited for."""
        if not self.outer_sync.run_started():
            return self.view.live_with_role(JOINING_ROLE, TRAINER_ROLE)
        return self.view.trainers()

    def _not_behind(self, peer: str) -> bool:
        return self.outer_sync.not_behind(peer)

    async def _train_guarded(self) -> None:
        try:
            await self._train()
        except LatticaError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)  # noqa: TRY400 - an expected failure: one line
        except ValueError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)  # noqa: TRY400 - an expected failure: one line
        except Exception as exc:  # a training bug must not take the node off the network
            self.phase, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("training failed")
        else:
            return
        self._leave_groups()
        await self._announce_failed()

    def _leave_groups(self) -> None:
        """Gossip partners asking for a step we will never open are answered at once."""
        if isinstance(self.groups, GossipGroups):
            self.groups.leave()

    async def _announce_failed(self) -> None:
        """Say in our member record that we train no more: still ``joining``, the others would
        wait for us at the start of a run (``START_WAIT_S``) and list us as loading forever. The
        reason stays in our own ``lattica status``: an error names local paths and settings."""
        try:
            await self.view.set_role(FAILED_ROLE)
        except (LatticaError, OSError) as exc:  # the state is stopping or its log broke
            log.warning("could not publish the failed role: %s", exc)

    async def _train(self) -> None:
        self.phase = "waiting for peers"
        # "joining" until we can sync: round coordinators do not wait for a peer that is still
        # loading, resuming or fetching (after a restart that takes seconds)
        await self.view.set_role(JOINING_ROLE)
        # ``min_peers`` gates the start of a run; a peer (re)joining a run that is already past
        # round 0 trains with whoever is live, or a restart after a crash could wait forever
        await self._wait_for_peers_or_a_running_swarm()
        # the run config an admin published wins over ours (``run_config.py``)
        self.phase = "agreeing on the run config"
        self.settings = await agree_run_config(self.view, self.settings, wait_s=self.settings.round_deadline_s)
        self.outer_sync.settings = self.settings
        self._gossips = _averages_in_groups(self.settings)
        if self.settings.tune:
            self.tuner = RunTuner(
                self.view, self.settings, round_trip_times=self.node.round_trip_times, traffic=self.tensors.stats
            )
        if self._gossips:
            await self._start_gossip_groups()
        self.phase = "loading"
        trainer = await self._build_trainer()
        # the same model and data as the run, or no training (``run_config.py``)
        await agree_run_identity(
            self.view, self.settings, trainer_factory.run_identity(trainer.task), wait_s=self.settings.round_deadline_s,
        )
        self.trainer, self.strategy = trainer, trainer.strategy
        self.outer_sync.bind(trainer)
        await self.view.set_device(trainer.device.describe())
        if await trio.to_thread.run_sync(trainer.resume):
            self.outer_sync.resumed()
        # a fresh peer, or one restarted from a checkpoint the swarm has moved past, takes the
        # swarm's outer state — with gossip, where replicas differ, the newest published replica
        # (one holder, hash-verified); eager DiLoCo starts from its own
        if trainer.strategy.replicas_agree or self._gossips:
            await self.outer_sync.join_running_swarm(on_fetch=self._fetching)
        await self.view.set_role(TRAINER_ROLE)
        if self._ownership is not None:
            await self._ownership.publish()
        await self._wait_for_members_still_loading()
        self.phase = "training"
        if self._begin_groups is not None:
            self._begin_groups()  # the first inner phase starts now: its length is our first pace
        summary = await trainer.run()
        self._leave_groups()  # partners asking for a step after our last are answered at once
        if self._nursery is not None:  # a full disk may have kept the last round from disk
            self._nursery.start_soon(trainer.checkpoint_until_written)
        self.summary = dataclasses.asdict(summary)
        self.phase = "done"
        log.info("training finished: %s", self.summary)
        await self.view.set_role(DONE_ROLE)  # no longer a round candidate
        if trainer.strategy.replicas_agree:
            await self._settle(trainer)

    def _fetching(self) -> None:
        self.phase = "fetching outer state"

    async def _build_trainer(self) -> Trainer:
        s = self.settings
        if trainer_factory.trains_experts(s):  # SPES: expert ownership kept in the replicated state
            self._ownership = ReplicatedOwnership(
                self.view, num_experts=trainer_factory.expert_count(s), candidates=self._candidates,
            )
        # a member that goes silent inside a sync (link cut, frozen) breaks no connection: the
        # guard aborts a sync whose data plane received nothing for a round deadline
        collective = StallGuardedCollective(
            self.tensors, progress=self.tensors.stats.total_received, stall_s=s.round_deadline_s,
            alive=self.liveness.heard,
        )
        parts = trainer_factory.TrainerParts(
            peer_id=self.peer_id, collective=collective, groups=self.groups or self.coordinator,
            checkpoint_dir=self.node.config.data_dir / "checkpoints",
            members=tuple(sorted(self.view.live_with_role(JOINING_ROLE, TRAINER_ROLE))),
            ownership=self._ownership, on_progress=self._on_progress, on_round=self._on_round,
            on_refused=self._refused,
        )
        return await trio.to_thread.run_sync(lambda: trainer_factory.build_trainer(s, parts, wrap=self._wrap))

    def _refused(self, rejection: Rejection) -> None:
        """The strategy refused a partner's contribution: score the peer down, and with gossip
        groups leave it out of this peer's next draws."""
        self.tensors.score_down(rejection)
        if isinstance(self.groups, GossipGroups):
            self.groups.avoid(rejection.peer)

    def _wrap(self, strategy: OuterStrategy[object]) -> OuterStrategy[object]:
        """Outer-state sync around the strategy: catch-up and repair where replicas agree,
        keeping up with the newest replica where they average in groups; inside them, the tuned
        sync schedule with ``tune = true``."""
        if self.tuner is not None:
            strategy = self.tuner.wrap(strategy)
        if strategy.replicas_agree:
            return CatchingUpStrategy(strategy, self.outer_sync)
        if self._gossips:
            return KeepingUpStrategy(strategy, self.outer_sync)
        return strategy

    async def _wait_for_peers_or_a_running_swarm(self) -> None:
        """Until ``min_peers`` members are live, or the run is past round 0: some holder serves
        the state the others published (a claimed round that nobody serves is no run)."""
        while len(self.view.live_with_role(JOINING_ROLE, TRAINER_ROLE)) < self.settings.min_peers:
            agreed = self.outer_sync.agreed()
            if agreed is not None and await self.outer_sync.servable(agreed):
                return
            with trio.move_on_after(1.0):
                await self.view.wait_changed()

    async def _wait_for_members_still_loading(self) -> None:
        """At the start of a run, until every other member that announced itself (``joining``,
        connected and heartbeating) has loaded, at most ``START_WAIT_S`` (or a round deadline
        when longer). Members load at their own pace (reading the corpus, fetching a claim
        that turns out unservable): a round coordinator waits a round deadline from the first
        arrival, and a member still loading then ran the first rounds alone, as did the
        others. Mid-run this does not apply: a joiner is caught up instead."""
        with trio.move_on_after(max(START_WAIT_S, self.settings.round_deadline_s)) as waited:
            while not self.outer_sync.run_started() and self._members_still_loading():
                self.phase = "waiting for peers to load"
                with trio.move_on_after(0.5):
                    await self.view.wait_changed()
        if waited.cancelled_caught:
            log.warning("starting the run without the members still loading: %s", self._members_still_loading())

    def _members_still_loading(self) -> list[str]:
        connected = self._connected()
        return [
            p for p in self.view.live_with_role(JOINING_ROLE)
            if p != self.peer_id and p in connected and self.liveness.heard(p)
        ]

    async def _settle(self, trainer: Trainer) -> None:
        """After the last round, keep taking the run's final state while the node is up: a
        replica whose last round failed, ran alone or ran cut off ends identical to the others.
        A final round run alone is published too: two replicas that each finished on their own
        would otherwise each see the other's older claim and neither would ever adopt; with
        both final states published, ``repair_target``'s tie-break picks the same one for both."""
        await self.outer_sync.publish_if_unpublished()
        while True:
            if await self.outer_sync.repair_if_diverged():
                # the weights are now the adopted state's: the summary's val loss must be its
                # (not that of the lone or skipped last round it replaced)
                await trainer.revalidate()  # reports through _on_progress
                self.summary = dataclasses.asdict(trainer.summary())
            with trio.move_on_after(1.0):
                await self.view.wait_changed()

    async def _start_gossip_groups(self) -> None:
        """Each peer derives its group from the live trainers it holds and confirms it with its
        group only; a partner whose heartbeat stopped is not asked."""
        from lattica.coordination.groups import GossipGroupsConfig

        assert self._nursery is not None
        groups = GossipGroups(
            self.node.host, peer_id=self.peer_id, run_id=self.node.config.run_id, members=self.view.trainers,
            config=GossipGroupsConfig(group_size=self.settings.group_size, grace_s=self.settings.group_grace_s),
            responsive=self.liveness.heard,
        )
        self.groups, self._begin_groups = groups, groups.begin
        await self._nursery.start(groups.run)

    # -- progress ----------------------------------------------------------------------------

    def _on_progress(self, progress: Progress) -> None:
        per_token = self.trainer.task.bytes_per_token if self.trainer is not None else None
        val_bpb = None  # comparable across tokenizers
        if progress.val_loss is not None and per_token:
            val_bpb = bits_per_byte(progress.val_loss, per_token)
        self.figures = ProgressFigures.of(progress, val_bpb=val_bpb)

    @property
    def progress(self) -> dict[str, float | int | None]:
        """The last progress record as ``lattica status`` shows it (empty before the first)."""
        return self.figures.as_json() if self.figures is not None else {}

    def _on_round(self, event: RoundCompleted) -> None:
        report = event.report
        self._bytes_sent += report.bytes_sent
        if report.consensus_distance is not None:
            self._consensus_distance = report.consensus_distance
        if len(report.group) > 1:
            op = "exchange" if self._gossips else "allreduce"
            self.node.metrics.collective_seconds.labels(op=op).observe(report.seconds)
        if report.skipped:
            log.info("sync %s skipped: %s", report.key, report.detail)
            return
        log.info("sync %s done with %d member(s) in %.2f s", report.key, len(report.group), report.seconds)
        if len(report.group) > 1 and report.seconds > 0:
            self._last_group, self._round_bps = report.group, report.bytes_sent * 8 / report.seconds
            self._round_bytes = report.bytes_sent
        if self.tuner is not None and self._nursery is not None and self.trainer is not None:
            self._nursery.start_soon(self.tuner.after_round, report, self.trainer.step)
        if self.outer_sync.round_completed(report, event.state_hash) and self._nursery is not None:
            self._nursery.start_soon(self.outer_sync.publish_round)

    # -- control API ---------------------------------------------------------------------------

    def statistics(self) -> TrainingStatus:
        """Where training stands: read by the node's metrics exporter, shown by ``lattica status``."""
        strategy = self.strategy
        writer = self.trainer.checkpoint_writer if self.trainer is not None else None
        return TrainingStatus(
            phase=self.phase,
            strategy=self.settings.strategy,
            replicas_agree=bool(strategy is not None and strategy.replicas_agree),
            rounds_target=self.settings.rounds,
            rounds_completed=strategy.completed_rounds if strategy is not None else 0,
            bytes_sent=self._bytes_sent,
            bytes_received=self.tensors.stats.total_received(),
            device=self.trainer.device.describe() if self.trainer is not None else None,
            compiled=self.trainer.forward.compiled if self.trainer is not None else None,
            progress=self.figures,
            rejected_contributions={p: n for p, n in self.tensors.stats.rejected_contributions.items() if n},
            gossip=self._gossip_figures() if self._gossips else None,
            error=self.error,
            checkpoints_failing=writer.failing if writer is not None else None,
            failed_members=tuple(p for p in self.view.failed() if p != self.peer_id),
            refused_states=self.outer_sync.refused_states(),
            summary=self.summary,
            devices=self.trainer.device_status() if self.trainer is not None else {},
            tuned=self.tuner.status(self.trainer.step if self.trainer is not None else 0) if self.tuner else None,
        )

    def _gossip_figures(self) -> GossipFigures:
        groups = self.groups
        return GossipFigures(
            avoided_partners=tuple(groups.avoided()) if isinstance(groups, GossipGroups) else (),
            overlap=self.settings.gossip_overlap,
            consensus_distance=_rounded(self._consensus_distance, 6),
        )

    def status(self) -> dict[str, object]:
        """``{"training": ...}``: this service's part of ``lattica status``."""
        return {"training": self.statistics().as_json()}

    def doctor_facts(self, facts: NodeFacts) -> NodeFacts:
        """``facts`` with the last large tensor message sent to each peer (``lattica doctor``)."""
        return facts.with_last_transfers(self.tensors.stats.last_sent)

    def accounting(self) -> dict[str, int]:
        """The strategy's traffic and memory figures (empty before it is built)."""
        return self.strategy.accounting() if self.strategy is not None else {}

    async def handle_control(self, request: ControlRequest) -> object | None:
        if request.method == "train":
            return self.statistics().as_json()
        if request.method == "tune":
            return await self.measure()
        return None

    async def measure(self) -> dict[str, object]:
        """The ``tune`` control request: this node's figures for ``lattica tune`` (``tuner.measure``)."""
        trainer = self.trainer
        if trainer is None:
            raise LocalProtocolError("tune: training has not started on this node yet")
        timed = self.tuner.strategy if self.tuner is not None else None
        step_s, cpu = None, 0.0
        if timed is not None:
            s = self.settings
            overlapped = bool(fixed_knobs(s.strategy, s.averaging, s.group_size, s.gossip_overlap)["overlap"])
            step_s, cpu = step_and_comm_cpu(timed.timer, overlapped=overlapped, bytes_sent=self._round_bytes)
        rate = self.figures.tokens_per_s if self.figures is not None else None
        if step_s is None and rate is not None and rate > 0:  # wall time: syncs included
            step_s = self.settings.batch_size * self.settings.seq_len / rate
        return await measure(
            self.node.round_trip_times, self.tensors.stats, peer_id=self.peer_id,
            group=self._last_group or tuple(self.view.trainers()), step_s=step_s,
            model_bytes=4 * sum(p.numel() for p in trainer.model.parameters()), round_bps=self._round_bps,
            comm_cpu_s_per_byte=cpu, comm_cpu_s_per_round=cpu * self._round_bytes,
            shared_cores=all(p.device.type == "cpu" for p in trainer.model.parameters()),
            steps_left=max(0, self.settings.rounds * self.settings.inner_steps - trainer.step),
        )


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _averages_in_groups(settings: TrainSettings) -> bool:
    try:
        return trainer_factory.averages_in_groups(settings)
    except (LatticaError, ValueError):  # refused settings fail the training with their own error
        return False


def check_settings(settings: TrainSettings) -> None:
    """Fail at start-up, as one line, on settings that cannot run (see ``settings_check``).
    A prepared corpus's shards are not hashed again here: ``lattica join`` did that before it
    built the node (the building trainer still checks every shard's size)."""
    from lattica.train.settings.settings_check import check_settings as check

    check(settings, verify_shards=False)
