"""TrainingService's view of its peers: who is responsive (heartbeats, settling, who is behind) and
whether a round of one was run alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lattica.config import TrainSettings
from lattica.crdt.liveness import LeasePolicy
from lattica.train import service as service_module
from lattica.train.service import TrainingService


class _Id:
    def __init__(self, text: str) -> None:
        self.text = text

    def to_base58(self) -> str:
        return self.text


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(service_module.time, "monotonic", clock)
    return clock


def _service(snapshot: dict[str, Any], connected: list[str], live: list[str] | None = None) -> TrainingService:
    host = SimpleNamespace(get_connected_peers=lambda: [_Id(p) for p in connected])
    node = SimpleNamespace(peer_id=_Id("me"), host=host)
    state = SimpleNamespace(
        snapshot=lambda: snapshot, config=SimpleNamespace(lease=LeasePolicy()),
        live_members=lambda: list(live if live is not None else ["me"]),
    )
    return TrainingService(node, state, TrainSettings())


def _beat(snapshot: dict[str, Any], peer: str, beat: int) -> None:
    snapshot["members"][peer] = {"role": "trainer", "heartbeat": beat}


def test_a_peer_back_from_silence_settles_before_it_is_waited_for(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {}, "progress": {"a": {"round": 7}}}
    service = _service(snapshot, ["a"])
    service._mine = (9, "h")
    _beat(snapshot, "a", 1)
    assert service._responsive("a")
    clock.now += 4.0  # no lease renewal for 4 heartbeats: silent
    assert not service._responsive("a")
    _beat(snapshot, "a", 2)  # heard again, but behind us: it catches up first
    clock.now += 1.0
    assert not service._responsive("a")
    _beat(snapshot, "a", 3)
    clock.now += 3.0
    assert service._responsive("a")


def test_peers_that_are_not_behind_need_no_settling(clock: _Clock) -> None:
    # seen from a peer whose own link was cut: everyone went silent, and everyone is ahead
    snapshot: dict[str, Any] = {"members": {}, "progress": {"a": {"round": 7}}}
    service = _service(snapshot, ["a"])
    service._mine = (5, "h")
    _beat(snapshot, "a", 1)
    assert service._responsive("a")
    clock.now += 4.0
    assert not service._responsive("a")
    _beat(snapshot, "a", 2)
    clock.now += 0.5
    assert service._responsive("a")


def test_a_disconnected_peer_is_not_responsive(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {}, "progress": {}}
    service = _service(snapshot, [])
    _beat(snapshot, "a", 1)
    assert not service._responsive("a")


def test_a_round_of_one_after_our_link_was_cut_was_run_alone(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live = ["a", "me"]
    service = _service(snapshot, ["a"], live)
    assert not service._ran_alone(SimpleNamespace(skipped=False, group=("a", "me")))  # a full round
    live.remove("a")  # cut off: a's lease runs out here, but no connection broke
    clock.now += 6.0
    assert service._ran_alone(SimpleNamespace(skipped=False, group=("me",)))


def test_a_round_of_one_after_the_others_were_killed_is_the_runs_round(clock: _Clock) -> None:
    snapshot: dict[str, Any] = {"members": {"me": {"role": "trainer"}, "a": {"role": "trainer"}}, "progress": {}}
    live, connected = ["a", "me"], ["a"]
    service = _service(snapshot, connected, live)
    assert not service._ran_alone(SimpleNamespace(skipped=False, group=("a", "me")))
    connected.remove("a")  # killed: its connection dropped, then its lease ran out
    live.remove("a")
    clock.now += 6.0
    assert not service._ran_alone(SimpleNamespace(skipped=False, group=("me",)))


class _Strategy:
    def __init__(self) -> None:
        self.synced: list[int] = []

    async def after_inner_step(self, step: int) -> list[Any]:
        self.synced.append(step)
        return []

    def next_sync_step(self, step: int) -> int:
        return step + 10


async def test_no_sync_for_the_old_step_after_a_state_was_adopted_there() -> None:
    service = _service({"members": {}, "progress": {}}, connected=[])
    service.strategy = strategy = _Strategy()
    adopting = [True]

    async def repair() -> bool:
        return adopting[0]

    service._repair_if_diverged = repair  # type: ignore[method-assign]
    service._wrap_strategy_for_catch_up()
    # the adopted state's round already ran; the trainer moved to its step
    assert await strategy.after_inner_step(10) == []
    assert strategy.synced == []
    adopting[0] = False
    await strategy.after_inner_step(20)
    assert strategy.synced == [20]
