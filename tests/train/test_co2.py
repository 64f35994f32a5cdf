"""CO2: the one-round-late outer step, its staleness gap penalty and momentum clip, by hand."""

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.train.engine.outer_state import outer_state_hash
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies.co2 import (
    CO2,
    MEAN_NOT_HELD,
    CO2Config,
    co2_outer_step,
    look_ahead,
    staleness_factors,
)
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_staleness_factor_is_one_plus_the_relative_movement_per_tensor():
    outer = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    base = [torch.tensor([0.0, 4.0]), torch.tensor([0.0])]
    # ‖(3, 0)‖ / ‖(0, 4)‖ = 0.75; a zero base gives no scale: 1
    assert staleness_factors(outer, base, 1.0) == [1.75, 1.0]
    assert staleness_factors(outer, base, 2.0) == [2.5, 1.0]
    assert staleness_factors(outer, base, 0.0) == [1.0, 1.0]


def test_outer_step_scales_by_the_penalty_then_clips_the_momentum():
    outer, momentum, base = [torch.tensor([3.0])], [torch.tensor([-2.0])], [torch.tensor([1.0])]
    # Λ = 1 + 2/1 = 3; m = 0.5·(−2) + (−2)/3 = −1.6667, clipped to −1.5; φ = 3 − 1·(−1.5)
    config = CO2Config(outer_lr=1.0, outer_momentum=0.5, staleness_penalty=1.0, momentum_clip=1.5)
    assert co2_outer_step(outer, momentum, base, [torch.tensor([-2.0])], config) == [3.0]
    assert momentum[0].item() == -1.5
    assert outer[0].item() == 4.5
    assert base[0].item() == 3.0  # where the pseudo-gradient launched at this sync was taken


def test_a_phase_starts_from_the_step_its_own_fresh_delta_would_give():
    phi, m = torch.tensor([3.0]), torch.tensor([-2.0])
    config = CO2Config(outer_lr=1.0, outer_momentum=0.5, momentum_clip=None)
    # s = φ − η·(μ·m + Δ_own) = 3 − (−1 − 1)
    assert look_ahead([phi], [m], [torch.tensor([-1.0])], config)[0].item() == 5.0
    clipped = CO2Config(outer_lr=1.0, outer_momentum=0.5, momentum_clip=1.5)
    assert look_ahead([phi], [m], [torch.tensor([-1.0])], clipped)[0].item() == 4.5
    assert phi.item() == 3.0
    assert m.item() == -2.0  # the shared state is not touched


async def _run(config, drift, rounds, start=1.0):
    """Replicas of a one-weight model whose inner phase adds ``drift[i]`` per step."""
    peers = [chr(ord("a") + i) for i in range(len(drift))]
    group = InMemoryCollectiveGroup(peers)
    models = [scalar_model(start) for _ in peers]
    strategies = [CO2(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
                  for m, p in zip(models, peers, strict=True)]
    reports = [[] for _ in peers]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, rounds + 1):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            reports[i] += await strategies[i].after_inner_step(step)
        reports[i] += await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            nursery.start_soon(replica, i, nursery)
    return models, strategies, reports


async def test_two_replicas_match_the_hand_computed_trajectory():
    config = CO2Config(inner_steps=1, outer_lr=1.0, outer_momentum=0.5, staleness_penalty=1.0, momentum_clip=None)
    models, strategies, reports = await _run(config, drift=[1.0, 3.0], rounds=3)
    # every round: Δ = s − θ = (−1, −3), mean −2, landed one round late; each phase starts
    # from its own look-ahead, which leaves the shared (φ, m) alone.
    # sync 1: nothing lands; s = φ − Δ_own = (2, 4).
    # sync 2: Λ = 1 (φ has not moved); m = −2; φ = 1 + 2 = 3.
    # sync 3: Λ = 1 + |3 − 1|/1 = 3; m = −1 − 2/3; φ = 3 + 5/3 = 14/3.
    # finish: Λ = 1 + (14/3 − 3)/3 = 14/9; m = −5/6 − 2·9/14; φ = 14/3 + 5/6 + 9/7.
    expected = 14 / 3 + 5 / 6 + 9 / 7
    for model, strategy in zip(models, strategies, strict=True):
        assert model.weight.item() == pytest.approx(expected, rel=1e-6)
        assert strategy.completed_rounds == 3
    assert reports[0][0].skipped
    assert "in flight" in reports[0][0].detail
    assert [r.round for r in reports[0][1:]] == [0, 1, 2]


async def test_replicas_hold_bit_identical_outer_state_and_a_joiner_adopts_it():
    torch.manual_seed(0)
    drift = [torch.randn(1, 1).item() for _ in range(4)]
    models, strategies, _ = await _run(CO2Config(inner_steps=1), drift=drift, rounds=5)
    states = [s.outer_state_dict() for s in strategies]
    for other in states[1:]:
        for group in ("params", "momentum", "base"):
            assert torch.equal(other[group]["weight"], states[0][group]["weight"])
    assert all(torch.equal(m.weight, models[0].weight) for m in models)
    joiner = scalar_model(-7.0)
    fresh = CO2(joiner, collective=InMemoryCollectiveGroup(["j"]).member("j"), groups=FixedGroups(["j"]))
    fresh.load_outer_state_dict(states[0])
    assert torch.equal(joiner.weight, models[0].weight)
    assert fresh.completed_rounds == 5
    with pytest.raises(ValueError, match="momentum"):
        fresh.load_outer_state_dict({**states[0], "momentum": {}})


def _replicas(peers, config):
    group = InMemoryCollectiveGroup(peers)
    models = [scalar_model(1.0) for _ in peers]
    return models, [CO2(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
                    for m, p in zip(models, peers, strict=True)]


async def _all(fn, count):
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(fn, i)


async def test_a_member_that_adopts_the_state_keeps_the_mean_it_awaits_in_flight():
    peers, drift = ["a", "b", "c"], [1.0, 2.0, 4.0]
    models, strategies = _replicas(peers, CO2Config(inner_steps=1))
    finished = [[] for _ in peers]
    async with trio.open_nursery() as nursery:
        for strategy in strategies:
            strategy.bind_nursery(nursery)
        for step in (1, 2, 3):
            async def inner_step(i, step=step):
                with torch.no_grad():
                    models[i].weight.add_(drift[i])
                await strategies[i].after_inner_step(step)
            await _all(inner_step, 3)
        held = strategies[0].outer_state_dict()  # round 2's all-reduce launched, its mean not landed
        assert held["awaiting"] == [2]
        assert held["completed_rounds"] == 2
        strategies[2].load_outer_state_dict(held)  # a repair: c took part in round 2's all-reduce
        assert strategies[2].lands_next_round()

        async def finish(i):
            finished[i] = await strategies[i].finish()
        await _all(finish, 3)
    assert [s.completed_rounds for s in strategies] == [3, 3, 3]
    assert [len(reports) for reports in finished] == [1, 1, 1]
    assert not finished[2][0].skipped
    hashes = {outer_state_hash(s.outer_state_dict()) for s in strategies}
    assert len(hashes) == 1
    assert strategies[2].outer_state_dict()["awaiting"] == []  # finished: nothing in flight


async def test_a_joiner_without_the_awaited_mean_reports_it_and_catches_up_with_the_holders_state():
    peers = ["a", "b"]
    models, strategies = _replicas(peers, CO2Config(inner_steps=1))
    async with trio.open_nursery() as nursery:
        for strategy in strategies:
            strategy.bind_nursery(nursery)
        for step in (1, 2):
            async def inner_step(i, step=step):
                with torch.no_grad():
                    models[i].weight.add_(1.0 + i)
                await strategies[i].after_inner_step(step)
            await _all(inner_step, 2)
        held = strategies[0].outer_state_dict()
        joiner = scalar_model(-7.0)
        fresh = CO2(joiner, collective=InMemoryCollectiveGroup(["j"]).member("j"), groups=FixedGroups(["j"]),
                    config=CO2Config(inner_steps=1))
        fresh.load_outer_state_dict(held)
        # the adopted state hashes as the holder's: the joiner publishes it as one more holder
        assert outer_state_hash(fresh.outer_state_dict()) == outer_state_hash(held)
        assert not fresh.lands_next_round()  # round 1's mean was in flight among a and b only
        fresh.bind_nursery(nursery)
        with torch.no_grad():
            joiner.weight.add_(1.0)
        [report] = await fresh.after_inner_step(3)
        assert report.skipped
        assert report.detail == MEAN_NOT_HELD
        assert fresh.completed_rounds == held["completed_rounds"]
        assert not fresh.lands_next_round()  # off the line until it adopts the holders' next state
        fresh.load_outer_state_dict(held | {"round": 3, "awaiting": [2], "completed_rounds": 2})
        assert fresh.lands_next_round()  # its own round-2 all-reduce is the one that state awaits
        await fresh.finish()
        await _all(lambda i: strategies[i].finish(), 2)


def test_an_awaited_round_other_than_the_last_launched_is_refused():
    _, [strategy] = _replicas(["a"], CO2Config())
    state = strategy.outer_state_dict()
    assert state["awaiting"] == []
    with pytest.raises(ValueError, match="awaiting"):
        strategy.load_outer_state_dict(state | {"round": 3, "awaiting": [1]})
    with pytest.raises(ValueError, match="awaiting"):
        strategy.load_outer_state_dict(state | {"round": 0, "awaiting": [-1]})
    strategy.load_outer_state_dict(state | {"round": 3, "awaiting": [2]})
    assert strategy.outer_state_dict()["awaiting"] == [2]


async def test_a_failed_all_reduce_skips_that_rounds_outer_step():
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    model = scalar_model(1.0)
    strategy = CO2(model, collective=group.member("a"), groups=FixedGroups(peers),
                   config=CO2Config(inner_steps=1, max_attempts=2))
    group.fail("b")
    async with trio.open_nursery() as nursery:
        strategy.bind_nursery(nursery)
        with torch.no_grad():
            model.weight.add_(1.0)
        await strategy.after_inner_step(1)
        [report] = await strategy.finish()
    assert report.skipped
    assert "b" in report.detail
    assert model.weight.item() == 1.0  # φ unchanged, θ ← φ
    assert strategy.completed_rounds == 0


def test_run_settings_reach_the_config():
    config = strategy_config(TrainSettings(strategy="co2", staleness_penalty=0.5, momentum_clip=0.0, outer_lr=0.8))
    assert config == CO2Config(staleness_penalty=0.5, momentum_clip=None, outer_lr=0.8)
    assert strategy_config(TrainSettings(strategy="co2")) == CO2Config()
