"""Keeping this replica's outer state on the run's: join, catch-up, repair and publishing.

Theory of operation: after each completed round a member publishes ``(round, weights hash)``
in the replicated state and serves its outer state for joiners (``outer_transfer.ServedRounds``).
A peer whose round ran without the others (it was late, or the all-reduce failed) catches up
the way a joiner does, before its next inner step, so replicas re-converge to bit-identical
outer weights; if no newer state came meanwhile, it publishes its own (a peer a round behind
it adopts that, and the two share rounds again). Which state to adopt is the one most live
peers hold (``outer_transfer.repair_target``, with our own hash history kept in the
checkpoints). Adopted states are checkpointed at once. A published (round, hash) that no holder
serves is distrusted (``membership.UnservableClaims``): it starts no run, marks nobody as
behind, and is offered for adoption again only after a back-off. A claim beyond the run, far
ahead of the others or (where replicas agree) ahead on one holder's word is not fetched, and a
fetched state that fails the checks is refused and its holders scored down (``adoption.py``,
``state_schema.py``); adopting never stops the trainer.

``OuterStateSync`` holds that logic; it reaches the trainer's strategy through two wrappers,
which implement the strategy interface around it (``strategies.base.WrappedStrategy``) rather
than patching its methods:

- ``CatchingUpStrategy`` (replicas agree): before a sync, catch up or repair; after one run
  alone or skipped, owe a catch-up (and stop the inner loop at the next step for it);
- ``KeepingUpStrategy`` (group averaging, replicas differ): a replica two or more rounds behind
  the newest published state adopts it, as a joiner does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import trio

from lattica.config import TrainSettings
from lattica.crdt.documents import ProgressRecord
from lattica.errors import LatticaError, PeerUnavailableError
from lattica.train.engine.outer_state import MANIFEST, outer_state_hash, read_manifest
from lattica.train.engine.trainer import Trainer
from lattica.train.ports import OuterStateStore
from lattica.train.strategies.base import OuterStepReport, OuterStrategy, WrappedStrategy
from lattica.train.swarm.adoption import ClaimScreen, RunPicture
from lattica.train.swarm.join import FetchPacing, fetch_outer_state, first_answer
from lattica.train.swarm.membership import (
    DONE_ROLE,
    TRAINER_ROLE,
    TRAINING_ROLES,
    MembershipView,
    UnservableClaims,
)
from lattica.train.swarm.outer_transfer import (
    ProbedManifests,
    ServedRounds,
    agreed_round,
    fetch_of_round,
    repair_target,
)
from lattica.train.swarm.state_schema import OuterStateSchema, check_outer_state

log = logging.getLogger(__name__)

CATCH_UP_WAIT_S = 5.0  # after a round run alone: the others' result of it is on its way
# after a skipped round: the members of the failed attempt skipped it too (a collective fails for
# all its members), so only a peer in another group may have completed it; waiting long for that
# holds up a whole swarm whose round failed
SKIPPED_WAIT_S = 1.0
_OTHERS_LOOK_S = 0.5  # while catching up: how often to look whether the others still train
_JOIN_ATTEMPTS = 4  # fetches when joining, failed or not
_REPAIR_RETRY_S = 2.0
_HISTORY_ROUNDS = 64  # own outer-state hashes remembered per round (see ``repair_target``)
_PROBE_TIMEOUT_S = 10.0  # asking a holder for the manifest of the state it published

Agreed = tuple[int, str, list[str]]  # round, weights hash, holders


class OuterStateSync:
    """Which outer state this replica should hold, and getting it there (module docstring).

    Built before the trainer (round candidates and responsiveness need ``agreed`` and
    ``not_behind`` from the start); ``bind`` gives it the trainer once it exists.
    """

    def __init__(
        self,
        view: MembershipView,
        store: OuterStateStore,
        settings: TrainSettings,
        *,
        ran_alone: Callable[[OuterStepReport], bool],
        others_in_rounds: Callable[[], bool] = lambda: True,
        on_fetched: Callable[[float], None] = lambda seconds: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view, self.store, self.settings = view, store, settings
        self.ran_alone, self.others_in_rounds = ran_alone, others_in_rounds
        self.on_fetched, self.clock = on_fetched, clock
        self.trainer: Trainer | None = None
        self.mine: tuple[int, str | None] = (0, None)  # completed rounds, outer state hash
        self.history: dict[int, str] = {}  # our outer-state hash of recent rounds, on one line
        self.catch_up_owed: float | None = None  # how long to wait for the others' state
        # a state one round ahead left to our next sync to reach (``_reached_at_next_sync``)
        self._left_to_next_sync: tuple[int, str] | None = None
        self._next_repair_at = 0.0
        self._served: ServedRounds | None = None
        self._unservable = UnservableClaims()  # (round, hash) claims no holder could serve
        self._probed = ProbedManifests()  # manifests fetched by ``servable``, for the fetch after it
        self._claims = ClaimScreen()  # claims that may not be adopted, holders that served bad states
        self._schema: OuterStateSchema | None = None  # our own outer state's, once the trainer exists
        self.pacing = FetchPacing()  # how long a silent holder may hold a probe or fetch (``join.py``)

    # -- what the run holds ------------------------------------------------------------------

    def agreed(self) -> Agreed | None:
        """The state most live peers published (claims backing off or refused left out)."""
        return agreed_round(self._adoptable_progress(), self.view.live(), self.view.peer_id)

    def _adoptable_progress(self) -> dict[str, ProgressRecord]:
        """The published progress without the claims backing off (``UnservableClaims``) and
        those that may not be adopted (``adoption.ClaimScreen``); new refusals are logged."""
        progress = self._unservable.trusted_progress(self.view.progress(), self.clock())
        kept, refusals = self._claims.admissible(progress, self._run_picture(), now=self.clock())
        for refusal in refusals:
            log.warning("%s", refusal.describe())
        return kept

    def _run_picture(self) -> RunPicture:
        view = self.view
        live = view.live()
        roles = {peer: view.role(peer) for peer in live}
        trainer = self.trainer  # before it exists (and the run's config is agreed) claims are only probed
        return RunPicture(
            me=view.peer_id, live=live, reporters=[p for p in live if roles[p] in (TRAINER_ROLE, DONE_ROLE)],
            members=sum(1 for p in live if roles[p] in TRAINING_ROLES), my_round=self.mine[0],
            rounds=self.settings.rounds if trainer is not None else None,
            replicas_agree=trainer is not None and trainer.strategy.replicas_agree,
        )

    def refused_states(self) -> dict[str, int]:
        """Holders by the number of bad outer states they served us (``lattica status``)."""
        return dict(self._claims.refusals)

    def run_started(self) -> bool:
        """Whether the run is past its start: we completed a round, or a live peer published
        one whose fetch has not failed (a claim nobody could serve starts no run)."""
        if self.mine[0] > 0:
            return True
        progress = {
            peer: record for peer, record in self.view.progress().items()
            if (claim := self.view.published_claim(peer)) is None or not self._unservable.distrusted(claim)
        }
        return agreed_round(progress, self.view.live(), self.view.peer_id) is not None

    def published_round(self, peer: str) -> int | None:
        """The round ``peer`` published, unless nobody could serve that claim."""
        claim = self.view.published_claim(peer)
        if claim is None or self._unservable.distrusted(claim):
            return None
        return claim[0]

    def not_behind(self, peer: str) -> bool:
        """Whether ``peer`` published at least the rounds we completed: it needs no catching up.
        Where means land a round late (CO2), one landing fewer is the same round of the
        all-reduce: it lands at the peer's coming sync (``rounds_landed_late``)."""
        rnd = self.published_round(peer)
        late = self.trainer.strategy.rounds_landed_late() if self.trainer is not None else 0
        return rnd is not None and rnd >= self.mine[0] - late and self.mine[0] > 0

    async def servable(self, agreed: Agreed) -> bool:
        """Whether a holder of ``agreed`` serves its manifest; if none does, the claim is
        distrusted (see ``membership.UnservableClaims``)."""
        rnd, digest, holders = agreed
        fetch = fetch_of_round(self.store.fetch, rnd)

        async def probe(holder: str) -> Mapping[str, torch.Tensor]:
            try:
                with trio.fail_after(_PROBE_TIMEOUT_S):
                    manifest = await fetch(holder, [MANIFEST])
                    read_manifest(manifest, peer_id=holder)
                    return manifest
            except (LatticaError, trio.TooSlowError) as exc:
                log.debug("holder %s does not serve round %d: %s", holder, rnd, exc)
                raise PeerUnavailableError(f"does not serve round {rnd}", peer_id=holder) from None

        try:
            # a holder cut off answers nothing for seconds: the next is asked meanwhile
            holder, manifest = await first_answer(holders, probe, hedge_s=self.pacing.hedge_s)
        except PeerUnavailableError:
            pass
        else:
            self._probed.keep(holder, rnd, manifest)
            return True
        period = self._unservable.failed((rnd, digest), self.clock())
        log.warning("no holder serves the published state of round %d; ignoring that claim for %.0f s", rnd, period)
        return False

    # -- this replica ------------------------------------------------------------------------

    def bind(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("OuterStateSync.bind(trainer) must come before syncing")
        return self.trainer

    def resumed(self) -> None:
        """The trainer resumed from its checkpoint: take the hash history saved with it."""
        trainer = self._trainer()
        saved = trainer.annotations.get("outer_history", {})
        if isinstance(saved, dict):
            self.history = {int(r): h for r, h in saved.items() if isinstance(h, str)}
        self.remember(trainer.strategy.completed_rounds, outer_state_hash(trainer.strategy.outer_state_dict()))

    def remember(self, rnd: int, digest: str | None) -> None:
        self.mine = (rnd, digest)
        if digest is None:
            return
        self.history[rnd] = digest
        for old in sorted(self.history)[:-_HISTORY_ROUNDS]:
            del self.history[old]
        if self.trainer is not None:  # saved with the next checkpoint
            self.trainer.annotations["outer_history"] = dict(self.history)

    def round_completed(self, report: OuterStepReport, state_hash: str | None) -> bool:
        """Record a completed round; True when it should be published now. A round run alone
        while others train is replaced by theirs (catch-up publishes that); publishing it at
        once would offer the others a minority state (it is published when nothing of theirs
        came: ``publish_if_unpublished``). Where replicas differ by design, every replica's
        state is its own, and is published."""
        strategy = self._trainer().strategy
        self.remember(strategy.completed_rounds, state_hash)
        self._check_reached(strategy.completed_rounds, state_hash)
        return not self.ran_alone(report) or not strategy.replicas_agree

    # -- joining, catching up, repairing -----------------------------------------------------

    async def join_running_swarm(self, on_fetch: Callable[[], None] = lambda: None) -> bool:
        """Take the swarm's state when it is ahead of ours (a joiner, or a peer restarted from
        a checkpoint the swarm has moved past); True when one was adopted. The holders move on
        every round and a fetch that straddles one fails its hash check: look at the state again
        and retry. A fetch that succeeded may have taken longer than a round too: while the swarm
        is still ahead, adopt its newer state before the first inner step, rather than start
        training and adopt it after that step (the repair check), a trainer start later."""
        adopted = False
        for _ in range(_JOIN_ATTEMPTS):
            agreed = self.agreed()
            if agreed is None or agreed[0] <= self._trainer().strategy.completed_rounds:
                return adopted
            on_fetch()
            if await self.adopt(agreed):
                await self.publish_round()  # a holder now, and counted at that round
                adopted = True
        return adopted

    async def adopt(self, agreed: Agreed) -> bool:
        """Fetch, check and load the state of ``agreed``; True when it is now ours. A state that
        cannot be fetched backs off (``UnservableClaims``); one that fails the checks is refused
        and its holders scored down (``adoption.ClaimScreen``). Nothing raised while adopting
        stops the trainer: the claim is refused instead."""
        rnd, digest, holders = agreed
        started = self.clock()
        flat = await self._fetch(agreed)
        if flat is None or not await self._load_checked(agreed, flat):
            return False
        self._unservable.served((rnd, digest))
        self.on_fetched(self.clock() - started)
        trainer = self._trainer()
        self.history = {trainer.strategy.completed_rounds: digest}  # rounds past it were another line
        await self._checkpoint_adopted()
        self.remember(trainer.strategy.completed_rounds, digest)  # reported once durable
        log.info(
            "adopted outer state of round %d from %d holder(s) in %.2f s", rnd, len(holders), self.clock() - started,
        )
        return True

    async def _fetch(self, agreed: Agreed) -> Mapping[str, torch.Tensor] | None:
        """The hash-verified flat state of ``agreed``, or None (the claim then backs off)."""
        rnd, digest, holders = agreed
        # a trainer catching up mid-run stays a round candidate while it fetches: the others are
        # in the inner steps of the round after the fetched one, and it asks for that round one
        # fetch after them; a coordinator that did not wait would make it run that round alone
        # too, and then the next (two trainers a round apart never met again)
        try:
            with trio.fail_after(max(30.0, self.settings.round_deadline_s)):
                fetch = self._probed.round_fetch(self.store.fetch, rnd)
                return await fetch_outer_state(holders, fetch, expected_hash=digest, pacing=self.pacing)
        except Exception as exc:  # noqa: BLE001 - whatever peers sent, the trainer goes on
            period = self._unservable.failed((rnd, digest), self.clock())
            log.warning("could not fetch outer state of round %d: %s; ignoring that claim for %.0f s", rnd, exc, period)
            return None

    async def _load_checked(self, agreed: Agreed, flat: Mapping[str, torch.Tensor]) -> bool:
        """Load ``flat`` into the trainer if it passes ``state_schema`` and, once loaded, its
        round is the claimed one; else refuse the claim (the trainer keeps its state)."""
        rnd, digest, holders = agreed
        trainer = self._trainer()

        def claimed_round_loaded() -> None:
            if trainer.strategy.completed_rounds != rnd:
                raise ValueError(f"its counters say round {trainer.strategy.completed_rounds}")

        try:
            schema = self._state_schema(trainer)
            outer = await trio.to_thread.run_sync(check_outer_state, flat, schema)
            step = int(outer.get("step", rnd * self.settings.inner_steps))
            trainer.adopt_outer_state(outer, step=step, check=claimed_round_loaded)
        except Exception as exc:  # noqa: BLE001 - whatever a state holds, the trainer goes on
            reason = str(exc) if isinstance(exc, LatticaError) else f"{type(exc).__name__}: {exc}"
            refusal = self._claims.refuse((rnd, digest), holders, reason, now=self.clock())
            log.warning("%s; their claims are ignored for %.0f s", refusal.describe(), self._claims.limits.ban_s)
            return False
        return True

    def _state_schema(self, trainer: Trainer) -> OuterStateSchema:
        if self._schema is None:
            own = trainer.strategy.outer_state_dict()
            self._schema = OuterStateSchema.of(own, max_count=trainer.config.total_steps)
        return self._schema

    async def _checkpoint_adopted(self) -> None:
        """Make an adopted state durable at once, and drop our checkpoints past it: after a
        restart we resume on the run's line, not on rounds it did not keep."""
        trainer = self._trainer()
        store = trainer.checkpoints
        if store is None:
            return
        trainer.annotations["outer_history"] = dict(self.history)
        await trainer.save_checkpoint()  # a full disk delays it (``CheckpointWriter``)
        await trio.to_thread.run_sync(store.discard_after, trainer.step)

    async def catch_up_or_repair(self) -> bool:
        """Before a sync: catch up when owed, else (and also) repair; True when a state was
        adopted. Runs after the trainer checkpointed the previous round: a kill during a fetch
        never loses a completed round."""
        adopted = False
        if self.catch_up_owed is not None:
            wait_s, self.catch_up_owed = self.catch_up_owed, None
            adopted = await self._catch_up(wait_s)
            if not adopted:  # nobody has a newer state: ours is the run's newest
                await self.publish_if_unpublished()
        return await self.repair_if_diverged() or adopted

    def owe_catch_up(self, reports: Sequence[OuterStepReport]) -> None:
        """After a sync: one run alone or skipped is followed by a catch-up."""
        if any(self.ran_alone(report) for report in reports):
            self.catch_up_owed = CATCH_UP_WAIT_S
        elif any(report.skipped for report in reports):
            self.catch_up_owed = SKIPPED_WAIT_S

    async def _catch_up(self, wait_s: float) -> bool:
        """After a round we skipped or ran alone: wait (briefly) for the others' result of it.
        True when a state was adopted. The wait ends early when every member we ran without is
        restarting (``others_in_rounds``): none of them brings a result of that round, and a
        restarted one must find ours published, or it resumes its checkpoint's round — one we
        already ran — and runs that alone too."""
        with trio.move_on_after(wait_s):
            while True:
                agreed = self.agreed()
                if agreed is not None and (agreed[0], agreed[1]) != self.mine and agreed[0] >= self.mine[0]:
                    if self._reached_at_next_sync(agreed):  # a faster member's: ours lands it
                        return False
                    if await self.adopt(agreed):
                        await self.publish_round()
                        return True
                    return False
                if not self.others_in_rounds():
                    return False
                with trio.move_on_after(_OTHERS_LOOK_S):  # a lease running out changes no record
                    await self.view.wait_changed()
        return False

    async def repair_if_diverged(self) -> bool:
        """Adopt the state most live peers hold when ours is not on it (see ``repair_target``);
        True when a state was adopted."""
        if self.clock() < self._next_repair_at:
            return False
        target = repair_target(self._adoptable_progress(), self.view.live(), self.view.peer_id, self.mine, self.history)
        if target is None or self._reached_at_next_sync(target):
            return False
        log.info("outer state differs from the swarm's round %d: adopting it", target[0])
        return await self._adopt_and_publish(target)

    def _reached_at_next_sync(self, target: Agreed) -> bool:
        """Whether ``target``, one round ahead of ours, is the state our own next sync reaches:
        a strategy that lands each round's mean one sync late (CO2) holds that mean in flight,
        and a faster member published the round it completes before we got there. Adopting it
        would throw away our inner phase and our part in the all-reduce it awaits. Its hash is
        kept: our state of that round must match it (``_check_reached``)."""
        rnd, digest, _ = target
        if rnd != self.mine[0] + 1 or not self._trainer().strategy.lands_next_round():
            return False
        self._left_to_next_sync = (rnd, digest)
        return True

    def _check_reached(self, rnd: int, digest: str | None) -> None:
        """After a round: a state left to this sync (``_reached_at_next_sync``) that ours does
        not match means our line strayed — catch up at once."""
        expected, self._left_to_next_sync = self._left_to_next_sync, None
        if expected is not None and expected[0] == rnd and expected[1] != digest:
            log.info("outer state of round %d differs from the one the swarm published: catching up", rnd)
            self.catch_up_owed = SKIPPED_WAIT_S

    async def adopt_if_behind(self) -> bool:
        """Group averaging: a replica two or more rounds behind the newest published state (it
        was frozen, cut off, or is slow) adopts that state, as a joiner does. Its partners
        answer a step they have left with "gone": behind, it would average alone for good."""
        agreed = self.agreed()
        completed = self._trainer().strategy.completed_rounds
        if agreed is None or agreed[0] < completed + 2 or self.clock() < self._next_repair_at:
            return False
        log.info("%d round(s) behind the newest published replica: adopting it", agreed[0] - completed)
        return await self._adopt_and_publish(agreed)

    async def _adopt_and_publish(self, target: Agreed) -> bool:
        if await self.adopt(target):
            await self.publish_round()
            return True
        self._next_repair_at = self.clock() + _REPAIR_RETRY_S
        return False

    # -- publishing --------------------------------------------------------------------------

    async def publish_if_unpublished(self) -> None:
        """Publish our last round if it ran alone and nobody's result of it came (see
        ``_catch_up``): a peer a round behind us must see that it is, and adopt our state —
        otherwise each reaches every round after the other sealed it, runs it alone, and the
        two never meet again."""
        if self.published_round(self.view.peer_id) != self._trainer().strategy.completed_rounds:
            await self.publish_round()

    async def publish_round(self) -> None:
        strategy = self._trainer().strategy
        outer = strategy.outer_state_dict()
        rnd = strategy.completed_rounds
        if self._served is None:
            self._served = ServedRounds(self.store)
        self._served.publish(rnd, outer)
        digest = outer_state_hash(outer)  # weights and outer optimizer state: what joiners verify
        self.remember(rnd, digest)
        await self.view.publish_progress(rnd, digest)


class CatchingUpStrategy(WrappedStrategy):
    """Replicas agree: catch up and repair before a sync, owe a catch-up after one run alone or
    skipped — and then stop the inner loop at the next step (the trainer runs the steps up to
    the next sync in one go)."""

    def __init__(self, inner: OuterStrategy[object], sync: OuterStateSync) -> None:
        super().__init__(inner)
        self.sync = sync

    def next_sync_step(self, step: int) -> int | None:
        return step + 1 if self.sync.catch_up_owed is not None else self.inner.next_sync_step(step)

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if await self.sync.catch_up_or_repair():
            # the trainer now stands at the adopted state's step, whose round already ran:
            # syncing for ``step`` too would run one round more than the steps (and every
            # replica that later adopts our state would inherit that offset)
            return []
        reports = await self.inner.after_inner_step(step)
        self.sync.owe_catch_up(reports)
        return reports


class KeepingUpStrategy(WrappedStrategy):
    """Replicas differ (group averaging): adopt the newest published state when two or more
    rounds behind it, before a sync."""

    def __init__(self, inner: OuterStrategy[object], sync: OuterStateSync) -> None:
        super().__init__(inner)
        self.sync = sync

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if await self.sync.adopt_if_behind():
            return []  # the trainer stands at the adopted state's step (see the catch-up)
        return await self.inner.after_inner_step(step)
