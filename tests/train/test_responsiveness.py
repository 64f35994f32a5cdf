"""A training member's view of its peers (``PeerLiveness``: heartbeats, settling, who is behind,
whether a round of one was run alone) and the catch-up wrapper around its strategy."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lattica.config import TrainSettings
from lattica.crdt.liveness import LeasePolicy
from lattica.errors import PeerUnavailableError
from lattica.train.strategies.base import OuterStepReport, OuterStrategy
from lattica.train.swarm.liveness import PeerLiveness
from lattica.train.swarm.membership import MembershipView
from lattica.train.swarm.outer_sync import CatchingUpStrategy, OuterStateSync


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


def _view(snapshot: dict[str, Any], live: list[str] | None = None) -> MembershipView:
    state = SimpleNamespace(
        snapshot=lambda: snapshot, config=SimpleNamespace(lease=LeasePolicy()),
        live_members=lambda: list(live if live is not None else ["me"]),
    )
    return MembershipView(state, peer_id="me")  # type: ignore[arg-type]


def _sync(view: MembershipView, clock: _Clock, mine: tuple[int, str | None] = (0, None)) -> OuterStateSync:
    sync = OuterStateSync(view, store=None, settings=TrainSettings(), ran_alone=lambda report: False, clock=clock)  # type: ignore[arg-type]
    sync.mine = mine
    return sync


def _liveness(
    snapshot: dict[str, Any], connected: list[str], clock: _Clock, *, live: list[str] | None = None,
    mine: tuple[int, str | None] = (0, None),
) -> PeerLiveness:
    view = _view(snapshot, live)
    sync = _sync(view, clock, mine)
    return PeerLiveness(
        view, connected=lambda: set(connected), candidates=view.trainers, not_behind=sync.not_behind, clock=clock,
    )


def _beat(snapshot: dict[str, Any], peer: str, beat: int) -> None:
    snapshot["members"][peer] = {"role": "trainer", "heartbeat": beat}


def _report(*group: str) -> OuterStepReport:
    return OuterStepReport(round=0, key="round/0", group=group, bytes_sent=0, seconds=0.0)


def test_a_peer_back_from_silence_settles_before_it_is_waited_for(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {}, "progress": {"a": {"round": 7}}}
    peers = _liveness(snapshot, ["a"], clock, mine=(9, "h"))
    _beat(snapshot, "a", 1)
    assert peers.responsive("a")
    clock.now += 4.0  # no lease renewal for 4 heartbeats: silent
    assert not peers.responsive("a")
    _beat(snapshot, "a", 2)  # heard again, but behind us: it catches up first
    clock.now += 1.0
    assert not peers.responsive("a")
    _beat(snapshot, "a", 3)
    clock.now += 3.0
    assert peers.responsive("a")


def test_peers_that_are_not_behind_need_no_settling(clock: _Clock) -> None:
    # seen from a peer whose own link was cut: everyone went silent, and everyone is ahead
    snapshot: dict[str, Any] = {"members": {}, "progress": {"a": {"round": 7}}}
    peers = _liveness(snapshot, ["a"], clock, mine=(5, "h"))
    _beat(snapshot, "a", 1)
    assert peers.responsive("a")
    clock.now += 4.0
    assert not peers.responsive("a")
    _beat(snapshot, "a", 2)
    clock.now += 0.5
    assert peers.responsive("a")


def test_a_disconnected_peer_is_not_responsive(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {}, "progress": {}}
    peers = _liveness(snapshot, [], clock)
    _beat(snapshot, "a", 1)
    assert not peers.responsive("a")


def test_a_round_of_one_after_our_link_was_cut_was_run_alone(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live = ["a", "me"]
    peers = _liveness(snapshot, ["a"], clock, live=live)
    assert not peers.ran_alone(_report("a", "me"))  # a full round
    live.remove("a")  # cut off: a's lease runs out here, but no connection broke
    clock.now += 6.0
    assert peers.ran_alone(_report("me"))


def test_a_round_of_one_after_the_others_were_killed_is_the_runs_round(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live, connected = ["a", "me"], ["a"]
    peers = _liveness(snapshot, connected, clock, live=live)
    assert not peers.ran_alone(_report("a", "me"))
    connected.remove("a")  # killed: its connection dropped, then its lease ran out
    live.remove("a")
    clock.now += 6.0
    assert not peers.ran_alone(_report("me"))


def test_a_round_run_alone_while_the_other_restarts_waits_for_nobody(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live, connected = ["a", "me"], ["a"]
    peers = _liveness(snapshot, connected, clock, live=live)
    assert not peers.ran_alone(_report("a", "me"))
    connected.remove("a")  # killed: its lease is still current, so our next round ran alone
    assert peers.ran_alone(_report("me"))
    assert peers.others_in_rounds()  # a may still be in that round, as far as we know
    snapshot["members"]["a"] = {"role": "joining"}  # back from its restart, loading its checkpoint
    connected.append("a")
    assert not peers.others_in_rounds()


def test_a_member_cut_off_still_counts_as_in_the_rounds(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live = ["a", "me"]
    peers = _liveness(snapshot, ["a"], clock, live=live)
    peers.look()
    live.remove("a")  # our link was cut: a's lease runs out here, its connection stays
    clock.now += 6.0
    assert peers.ran_alone(_report("me"))
    assert peers.others_in_rounds()  # a trains on with the others: their result of it will come


class _Strategy(OuterStrategy):
    def __init__(self) -> None:
        super().__init__(None, collective=None, groups=None)  # type: ignore[arg-type]
        self.synced: list[int] = []

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        self.synced.append(step)
        return [_report("me")] if step == 30 else []

    def next_sync_step(self, step: int) -> int:
        return step + 10

    @property
    def completed_rounds(self) -> int:
        return len(self.synced)

    def outer_state_dict(self) -> dict[str, Any]:
        return {}

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        return None


class _Repairing(OuterStateSync):
    """Outer-state sync whose repair adopts a state while ``adopting`` (no network)."""

    adopting = True

    async def repair_if_diverged(self) -> bool:
        return self.adopting


async def test_no_sync_for_the_old_step_after_a_state_was_adopted_there(clock: _Clock) -> None:
    view = _view({"members": {}, "progress": {}})
    sync = _Repairing(view, store=None, settings=TrainSettings(), ran_alone=lambda report: True, clock=clock)  # type: ignore[arg-type]
    inner = _Strategy()
    strategy = CatchingUpStrategy(inner, sync)
    # the adopted state's round already ran; the trainer moved to its step
    assert await strategy.after_inner_step(10) == []
    assert inner.synced == []
    sync.adopting = False
    await strategy.after_inner_step(20)
    assert inner.synced == [20]
    assert strategy.next_sync_step(20) == 30  # the inner strategy's schedule
    await strategy.after_inner_step(30)  # a round of one while others train: a catch-up is owed
    assert sync.catch_up_owed is not None
    assert strategy.next_sync_step(30) == 31  # the trainer stops at once for it
    assert strategy.completed_rounds == inner.completed_rounds == 2  # the rest is the inner strategy's


class _NobodyServes:
    """A data plane on which every holder refuses (a claim that cannot be fetched)."""

    async def fetch(self, peer: str, names: Any) -> Any:
        raise PeerUnavailableError("serves nothing", peer_id=peer)


async def test_a_claim_nobody_serves_does_not_start_the_run_even_when_due_for_a_retry(clock: _Clock) -> None:
    # a member published round 999 under a hash it cannot serve: once a fetch failed, the run
    # has not started (members still loading stay round candidates and are waited for), also
    # after the back-off, when the claim is offered for adoption again
    snapshot: dict[str, Any] = {"members": {}, "progress": {"x": {"round": 999, "weights_hash": "d" * 64}}}
    view = _view(snapshot, live=["me", "x"])
    sync = OuterStateSync(
        view, store=_NobodyServes(), settings=TrainSettings(),  # type: ignore[arg-type]
        ran_alone=lambda report: False, clock=clock,
    )
    agreed = sync.agreed()
    assert agreed is not None
    assert sync.run_started()  # untried: a joiner fetches it
    assert not await sync.servable(agreed)
    assert not sync.run_started()
    clock.now += 60.0  # past the back-off
    assert sync.agreed() is not None
    assert not sync.run_started()
    snapshot["progress"]["y"] = {"round": 3, "weights_hash": "a" * 64}
    view.state.live_members = lambda: ["me", "x", "y"]  # type: ignore[method-assign]
    assert sync.run_started()  # a claim not (yet) refused
    del snapshot["progress"]["y"]
    sync.mine = (1, "b" * 64)
    assert sync.run_started()  # we completed a round ourselves
