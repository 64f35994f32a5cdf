"""Which published claims a replica may adopt (``adoption.ClaimScreen``), and that a refused
state leaves the trainer exactly as it was (``Trainer.adopt_outer_state`` is all or nothing)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.crdt.liveness import LeasePolicy
from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.outer_state import flatten_outer_state, outer_state_hash
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.swarm.adoption import AdoptionLimits, ClaimScreen, RunPicture, refusal_before_fetch
from lattica.train.swarm.membership import MembershipView
from lattica.train.swarm.outer_sync import OuterStateSync
from lattica.train.swarm.outer_transfer import round_prefix
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

LIMITS = AdoptionLimits(max_rounds_ahead=8, ban_s=60.0)
GOSSIP = RunPicture(
    me="me", live=("me", "a", "b", "c"), reporters=("me", "a", "b", "c"), members=4, my_round=10, rounds=100,
    replicas_agree=False,
)
ALLREDUCE = replace(GOSSIP, replicas_agree=True)


def _record(rnd: int, digest: str) -> dict[str, object]:
    return {"round": rnd, "weights_hash": digest}


def _rule(claim: tuple[int, str], holders: list[str], reports: dict[str, int], run: RunPicture = GOSSIP) -> str | None:
    refusal = refusal_before_fetch(claim, holders, reports, run, LIMITS)
    return None if refusal is None else refusal.kind


# -- the rules before a fetch ----------------------------------------------------------------------


def test_a_round_beyond_the_runs_rounds_is_refused() -> None:
    assert _rule((101, "h"), ["a"], {"b": 100}) == "beyond"
    assert _rule((100, "h"), ["a"], {"b": 100}) is None


def test_a_claim_more_than_k_rounds_beyond_every_other_member_is_refused() -> None:
    assert _rule((18, "h"), ["a"], {"a": 18, "b": 10, "c": 9}) is None  # exactly K ahead of b
    assert _rule((19, "h"), ["a"], {"a": 19, "b": 10, "c": 9}) == "ahead"
    assert _rule((60, "h"), ["a"], {"a": 60, "b": 10, "c": 55}) is None  # c is near it


def test_the_holders_and_this_replica_do_not_report_on_a_claim() -> None:
    # its holders' own records and ours are no independent report
    assert _rule((60, "h"), ["a", "b"], {"a": 60, "b": 60, "me": 10}) is None
    assert _rule((60, "h"), ["a"], {"a": 60, "me": 60, "b": 10}) == "ahead"


def test_where_replicas_agree_a_majority_of_holders_outweighs_members_behind() -> None:
    """Several members restarted at once lag together; the agreed state stays theirs to adopt."""
    run = replace(ALLREDUCE, live=("me", "a", "b", "c", "d"), reporters=("me", "a", "b", "c", "d"), members=5)
    assert _rule((60, "h"), ["a", "b", "c"], {"a": 60, "b": 60, "c": 60, "d": 43, "me": 40}, run) is None
    assert _rule((60, "h"), ["a", "b"], {"a": 60, "b": 60, "c": 43, "d": 43}, run) == "ahead"  # two against two
    assert _rule((60, "h"), ["a", "b", "c"], {"a": 60, "b": 60, "c": 60, "d": 43}, GOSSIP) == "ahead"


def test_before_the_runs_config_is_agreed_its_rounds_bound_nothing() -> None:
    """A joiner's own ``rounds`` may not be the run's yet: the claim is probed, not refused."""
    assert _rule((500, "h"), ["a"], {"a": 500, "b": 499}, replace(GOSSIP, rounds=None)) is None


def test_without_another_member_only_the_runs_rounds_bound_a_claim() -> None:
    """A run of two: a replica restarted far behind still adopts the other's state."""
    two = replace(GOSSIP, live=("me", "a"), reporters=("me", "a"), members=2, my_round=0)
    assert _rule((90, "h"), ["a"], {"a": 90}, two) is None
    assert _rule((101, "h"), ["a"], {"a": 101}, two) == "beyond"


def test_where_replicas_agree_moving_ahead_takes_two_holders() -> None:
    assert _rule((11, "h"), ["a"], {"a": 11, "b": 10}, ALLREDUCE) == "alone"
    assert _rule((11, "h"), ["a", "b"], {"a": 11, "b": 11}, ALLREDUCE) is None
    assert _rule((11, "h"), ["a"], {"a": 11, "b": 10}, GOSSIP) is None  # gossip: a claim has one holder


def test_a_founder_that_trained_alone_is_followed_by_newcomers_that_have_no_round() -> None:
    """Three members, only the founder has a round: refusing its state would leave the two
    newcomers at round 0 and the founder at round 3, never in one collective."""
    fresh = replace(ALLREDUCE, my_round=0)
    assert _rule((3, "h"), ["a"], {"a": 3}, fresh) is None
    assert _rule((3, "h"), ["a"], {"a": 3, "b": 1}, fresh) == "alone"  # another member's round: two words needed
    assert _rule((3, "h"), ["a"], {"a": 3}, replace(fresh, my_round=1)) == "alone"  # and so does ours


def test_a_lone_holder_is_followed_at_or_below_our_round_and_in_a_run_of_two() -> None:
    """The tie-break that re-converges replicas which each ran a round alone stays possible."""
    assert _rule((10, "h"), ["a"], {"a": 10, "b": 10}, ALLREDUCE) is None
    assert _rule((9, "h"), ["a"], {"a": 9, "b": 10}, ALLREDUCE) is None
    two = replace(ALLREDUCE, live=("me", "a"), reporters=("me", "a"), members=2)
    assert _rule((15, "h"), ["a"], {"a": 15}, two) is None


# -- the screen over published progress ------------------------------------------------------------


def _progress(**claims: tuple[int, str]) -> dict[str, dict[str, object]]:
    return {peer: _record(*claim) for peer, claim in claims.items()}


def test_refused_claims_are_left_out_and_reported_once_per_holder_and_reason() -> None:
    screen = ClaimScreen(LIMITS)
    progress = _progress(me=(10, "m"), a=(60, "x"), b=(10, "y"), c=(11, "z"))
    kept, refusals = screen.admissible(progress, GOSSIP, now=0.0)
    assert set(kept) == {"me", "b", "c"}
    assert [(r.holders, r.kind) for r in refusals] == [(("a",), "ahead")]
    assert "refused the outer state of round 60 claimed by a: 49 rounds beyond" in refusals[0].describe()
    # the holder's next implausible claim (every round a new one) is left out silently
    kept, refusals = screen.admissible({**progress, "a": _record(61, "x2")}, GOSSIP, now=1.0)
    assert set(kept) == {"me", "b", "c"}
    assert refusals == []


def test_claims_of_members_not_live_are_not_judged() -> None:
    screen = ClaimScreen(LIMITS)
    gone = replace(GOSSIP, live=("me", "b"), reporters=("me", "b"))
    kept, refusals = screen.admissible(_progress(a=(999, "x"), b=(10, "y")), gone, now=0.0)
    assert refusals == []
    assert set(kept) == {"a", "b"}  # agreed_round ignores peers that are not live


def test_a_holder_that_served_a_bad_state_is_left_out_for_the_ban() -> None:
    screen = ClaimScreen(LIMITS)
    refusal = screen.refuse((12, "bad"), ["a", "c"], "tensor 'w' is not finite", now=0.0)
    assert refusal.describe() == "refused the outer state of round 12 claimed by a, c: tensor 'w' is not finite"
    assert screen.refusals == {"a": 1, "c": 1}
    progress = _progress(a=(13, "next"), b=(10, "y"), c=(12, "bad"))
    kept, refusals = screen.admissible(progress, GOSSIP, now=30.0)
    assert set(kept) == {"b"}
    assert refusals == []
    # the ban ends: the holder's new claims count again, the refused one never does
    kept, _ = screen.admissible(progress, GOSSIP, now=61.0)
    assert set(kept) == {"a", "b"}


def test_a_banned_holder_neither_reports_nor_corroborates() -> None:
    screen = ClaimScreen(LIMITS)
    screen.refuse((5, "old"), ["c"], "bad", now=0.0)
    progress = _progress(a=(30, "x"), b=(10, "y"), c=(30, "x"))
    kept, refusals = screen.admissible(progress, ALLREDUCE, now=1.0)
    assert set(kept) == {"b"}
    assert [r.kind for r in refusals] == ["ahead"]  # c's round is no report, nor is c a second holder


def test_remembered_claims_and_notes_are_bounded() -> None:
    screen = ClaimScreen(AdoptionLimits(max_remembered=4))
    for i in range(20):
        screen.refuse((i + 1, f"h{i}"), [f"p{i}"], "bad", now=0.0)
        screen.admissible(_progress(**{f"q{i}": (500, "x")}), replace(GOSSIP, live=("me", f"q{i}")), now=0.0)
    assert len(screen._refused) == 4
    assert len(screen._noted) == 4


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_rounds_ahead"):
        AdoptionLimits(max_rounds_ahead=-1)
    with pytest.raises(ValueError, match="ban_s"):
        AdoptionLimits(ban_s=0)


# -- all or nothing --------------------------------------------------------------------------------

GPT = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)


def _batches():
    generator = torch.Generator().manual_seed(0)
    while True:
        data = torch.randint(0, 256, (2, 9), generator=generator)
        yield data[:, :-1], data[:, 1:]


def _trainer() -> Trainer:
    model = build_model(GPT, seed=0)
    strategy = DiLoCo(model, collective=InMemoryCollectiveGroup(["a"]).member("a"), groups=FixedGroups(("a",)),
                      config=DiLoCoConfig(inner_steps=2))
    config = TrainerConfig(total_steps=8, eval_every=0, log_every=8, schedule=ScheduleConfig(lr=1e-3, total_steps=8))
    return Trainer(Task(model=model, train_batches=_batches()), strategy, config, device=select_device("cpu"))


def _snapshot(trainer: Trainer) -> tuple[str, dict[str, torch.Tensor], int]:
    weights = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    return outer_state_hash(trainer.strategy.outer_state_dict()), weights, trainer.step


def _assert_unchanged(trainer: Trainer, before: tuple[str, dict[str, torch.Tensor], int]) -> None:
    digest, weights, step = _snapshot(trainer)
    assert digest == before[0]
    assert step == before[2]
    assert all(torch.equal(weights[n], before[1][n]) for n in weights)


def test_a_state_refused_once_loaded_leaves_the_trainer_as_it_was() -> None:
    trainer = _trainer()
    trainer.step = 3
    with torch.no_grad():  # inner progress since the last round: the model is not the outer state
        for p in trainer.model.parameters():
            p.add_(0.5)
    before = _snapshot(trainer)
    claimed = {**trainer.strategy.outer_state_dict(), "round": 50, "completed_rounds": 50, "step": 100}
    claimed["params"] = {n: t + 1.0 for n, t in claimed["params"].items()}

    def round_is_claimed() -> None:
        if trainer.strategy.completed_rounds != 7:
            raise ValueError("its counters say round 50")

    with pytest.raises(ValueError, match="round 50"):
        trainer.adopt_outer_state(claimed, step=100, check=round_is_claimed)
    _assert_unchanged(trainer, before)


def test_a_state_whose_load_fails_half_way_leaves_the_trainer_as_it_was() -> None:
    trainer = _trainer()
    before = _snapshot(trainer)
    claimed = trainer.strategy.outer_state_dict()
    claimed["params"] = {n: t - 1.0 for n, t in claimed["params"].items()}
    claimed["round"] = "not-a-round"  # the weights are copied before the round is read
    with pytest.raises(ValueError, match="not-a-round"):
        trainer.adopt_outer_state(claimed)
    _assert_unchanged(trainer, before)


# -- adopting through the outer-state sync ---------------------------------------------------------


class _Holder:
    """Serves one outer state under its round, as a member's data plane does."""

    def __init__(self, rnd: int, state: dict[str, Any]) -> None:
        self.served = {round_prefix(rnd) + n: t for n, t in flatten_outer_state(state).items()}

    async def fetch(self, peer: str, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.served[n].clone() for n in names}

    def serve(self, name: str, tensor: torch.Tensor) -> None: ...

    def unserve(self, name: str) -> None: ...


def _sync_serving(
    trainer: Trainer, rnd: int, state: dict[str, Any],
) -> tuple[OuterStateSync, tuple[int, str, list[str]]]:
    digest = outer_state_hash(state)
    snapshot = {
        "members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}},
        "progress": {"a": _record(rnd, digest)},
    }
    state_view = SimpleNamespace(
        snapshot=lambda: snapshot, config=SimpleNamespace(lease=LeasePolicy()), live_members=lambda: ["me", "a"],
    )
    view = MembershipView(state_view, peer_id="me")  # type: ignore[arg-type]
    settings = TrainSettings(rounds=4, inner_steps=2)
    sync = OuterStateSync(view, _Holder(rnd, state), settings, ran_alone=lambda report: False)  # type: ignore[arg-type]
    sync.bind(trainer)
    return sync, (rnd, digest, ["a"])


def _claimed(trainer: Trainer, rnd: int, **changes: Any) -> dict[str, Any]:
    state = trainer.strategy.outer_state_dict()
    state["params"] = {n: t + 0.25 for n, t in state["params"].items()}
    return {**state, "round": rnd, "completed_rounds": rnd, "step": rnd * 2, **changes}


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"round": "not-a-round"}, "'round' is not a valid count"),
        ({"completed_rounds": 3}, "its counters say round 3"),
        ({"params": None}, "not finite"),
    ],
)
async def test_a_bad_state_is_refused_without_stopping_the_trainer(changes: dict[str, Any], words: str) -> None:
    trainer = _trainer()
    if changes.get("params", 0) is None:
        params = trainer.strategy.outer_state_dict()["params"]
        changes["params"] = {n: torch.full_like(t, float("nan")) for n, t in params.items()}
    sync, agreed = _sync_serving(trainer, 2, _claimed(trainer, 2, **changes))
    assert sync.agreed() == agreed
    before = _snapshot(trainer)
    assert await sync.adopt(agreed) is False
    _assert_unchanged(trainer, before)
    assert sync.refused_states() == {"a": 1}
    assert sync.agreed() is None  # the holder's claims are left out now


async def test_an_error_inside_the_strategy_while_adopting_refuses_the_claim() -> None:
    trainer = _trainer()
    sync, agreed = _sync_serving(trainer, 2, _claimed(trainer, 2))

    def broken(state: dict[str, Any]) -> None:
        raise RuntimeError("a bug in loading")

    trainer.strategy.load_outer_state_dict = broken  # type: ignore[method-assign]
    assert await sync.adopt(agreed) is False
    assert sync.refused_states() == {"a": 1}


async def test_a_good_state_is_adopted() -> None:
    trainer = _trainer()
    state = _claimed(trainer, 2)
    sync, agreed = _sync_serving(trainer, 2, state)
    assert await sync.adopt(agreed) is True
    assert outer_state_hash(trainer.strategy.outer_state_dict()) == agreed[1]
    assert trainer.step == 4
    assert sync.refused_states() == {}


class _MovingSwarm(_Holder):
    """Serves the states of two rounds; while a member fetches the first, the holder publishes
    the second (a swarm of fast rounds moves on during a restarted member's fetch)."""

    def __init__(self, snapshot: dict[str, Any], first: tuple[int, dict[str, Any]], second: tuple[int, dict[str, Any]]):
        super().__init__(*first)
        self.served.update(_Holder(*second).served)
        self.snapshot, self.second = snapshot, second

    async def fetch(self, peer: str, names: list[str]) -> dict[str, torch.Tensor]:
        rnd, state = self.second
        self.snapshot["progress"]["a"] = _record(rnd, outer_state_hash(state))
        return await super().fetch(peer, names)


async def test_a_joining_member_adopts_again_before_its_first_inner_step_when_the_swarm_moved_on() -> None:
    """Before, it took round 2 and trained its inner steps from there, only to find at its
    first sync that the swarm had sealed round 3 meanwhile: those steps were thrown away for
    another adoption, a round later."""
    trainer = _trainer()
    first, second = (2, _claimed(trainer, 2)), (3, _claimed(trainer, 3))
    snapshot: dict[str, Any] = {
        "members": {"me": {"role": "joining"}, "a": {"role": "trainer"}},
        "progress": {"a": _record(2, outer_state_hash(first[1]))},
    }

    async def set_progress(rnd: int, digest: str) -> None:
        snapshot["progress"]["me"] = _record(rnd, digest)

    state_view = SimpleNamespace(
        snapshot=lambda: snapshot, config=SimpleNamespace(lease=LeasePolicy()), live_members=lambda: ["me", "a"],
        set_progress=set_progress,
    )
    view = MembershipView(state_view, peer_id="me")  # type: ignore[arg-type]
    sync = OuterStateSync(view, _MovingSwarm(snapshot, first, second), TrainSettings(rounds=4, inner_steps=2),  # type: ignore[arg-type]
                          ran_alone=lambda report: False)
    sync.bind(trainer)
    assert await sync.join_running_swarm() is True
    assert trainer.strategy.completed_rounds == 3
    assert outer_state_hash(trainer.strategy.outer_state_dict()) == outer_state_hash(second[1])
    assert snapshot["progress"]["me"]["round"] == 3


# -- a strategy that lands each round's mean one sync late (CO2) ---------------------------------


def _landing_late(*, lands_next: bool) -> Any:
    """A trainer whose strategy lands means a sync late and holds (or not) the awaited one."""
    strategy = SimpleNamespace(replicas_agree=True, lands_next_round=lambda: lands_next, rounds_landed_late=lambda: 1,
                               completed_rounds=1)
    return SimpleNamespace(strategy=strategy, annotations={})


def test_a_state_one_round_ahead_is_left_to_the_sync_that_lands_it() -> None:
    state = {"params": {"w": torch.zeros(2)}, "round": 3, "completed_rounds": 2, "step": 4}
    trainer = _landing_late(lands_next=True)
    sync, (_, digest, _) = _sync_serving(trainer, 2, state)
    sync.remember(1, "ours-at-1")
    # a faster member landed round 2 first: our own next sync lands the same mean, so no fetch
    assert trio.run(sync.repair_if_diverged) is False
    assert sync.refused_states() == {}
    trainer.strategy.completed_rounds = 2
    sync.round_completed(_report(), digest)  # ours matched: nothing owed
    assert sync.catch_up_owed is None
    trainer.strategy.completed_rounds = 1
    sync.remember(1, "ours-at-1")
    assert trio.run(sync.repair_if_diverged) is False
    trainer.strategy.completed_rounds = 2
    sync.round_completed(_report(), "another-line")  # ours did not: catch up at once
    assert sync.catch_up_owed is not None


def test_without_the_awaited_mean_a_state_one_round_ahead_is_adopted() -> None:
    state = {"params": {"w": torch.zeros(2)}, "round": 3, "completed_rounds": 2, "step": 4}
    sync, _ = _sync_serving(_landing_late(lands_next=False), 2, state)
    sync.remember(1, "ours-at-1")
    trio.run(sync.repair_if_diverged)  # tried: the stub trainer cannot load it, so it is refused
    assert sync.refused_states() == {"a": 1}


def test_a_member_one_landing_behind_is_not_behind_where_means_land_late() -> None:
    state = {"params": {"w": torch.zeros(2)}, "round": 2, "completed_rounds": 1, "step": 2}
    sync, _ = _sync_serving(_landing_late(lands_next=True), 1, state)
    sync.remember(2, "ours-at-2")
    assert sync.not_behind("a")  # published 1, we landed 2: the same round of the all-reduce
    sync.remember(3, "ours-at-3")
    assert not sync.not_behind("a")


def _report() -> Any:
    from lattica.train.strategies.base import OuterStepReport

    return OuterStepReport(round=1, key="round/1", group=("a", "me"), bytes_sent=0, seconds=0.0)
