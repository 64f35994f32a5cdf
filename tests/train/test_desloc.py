"""Local Adam and DES-LOC: which quantity is averaged when, by hand-computed cases."""

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import create_strategy
from lattica.train.strategies.desloc import (
    DESLOC,
    DESLOCConfig,
    LocalAdam,
    LocalAdamConfig,
    bytes_per_steps,
    due_quantities,
)
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_paper_periods_by_default_and_local_adam_averages_everything_every_round():
    desloc, local = DESLOCConfig(inner_steps=10), LocalAdamConfig(inner_steps=10)
    assert desloc.periods == {"params": 10, "exp_avg": 30, "exp_avg_sq": 60}
    assert [due_quantities(r, desloc) for r in range(1, 7)] == [
        ("params",), ("params",), ("params", "exp_avg"), ("params",), ("params",),
        ("params", "exp_avg", "exp_avg_sq"),
    ]
    assert all(due_quantities(r, local) == ("params", "exp_avg", "exp_avg_sq") for r in range(1, 7))
    # the paper's traffic: 1.5 P per K_x against Local Adam's 3 P
    assert bytes_per_steps(desloc, 4, 60) * 2 == bytes_per_steps(local, 4, 60) == 72


@pytest.mark.parametrize("bad", [{"first_moment_rounds": 0}, {"second_moment_rounds": -1}, {"inner_steps": 0},
                                 {"averaging": "ring"}, {"first_moment_rounds": 1.5}])
def test_bad_periods_are_refused(bad):
    with pytest.raises(ValueError, match="must be"):
        DESLOCConfig(**bad)


def _replicas(strategy_cls, config, weights, first, second):
    peers = [f"p{i}" for i in range(len(weights))]
    group = InMemoryCollectiveGroup(peers)
    replicas = []
    for peer, w, u, v in zip(peers, weights, first, second, strict=True):
        model = scalar_model(w)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        state = optimizer.state[model.weight]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.full_like(model.weight, u)
        state["exp_avg_sq"] = torch.full_like(model.weight, v)
        strategy = strategy_cls(model, collective=group.member(peer), groups=FixedGroups(peers), config=config)
        strategy.attach_inner_optimizer(optimizer)
        replicas.append((model, optimizer, strategy))
    return group, replicas


async def _sync_all(replicas, step):
    """Each replica's sync at ``step``; their round reports, in replica order."""
    reports = [None] * len(replicas)

    async def sync(i, strategy):
        reports[i] = await strategy.after_inner_step(step)

    async with trio.open_nursery() as nursery:
        for i, (_, _, strategy) in enumerate(replicas):
            nursery.start_soon(sync, i, strategy)
    return reports


def _state(replicas, key):
    return [opt.state[model.weight][key].item() for model, opt, _ in replicas]


async def test_desloc_averages_each_quantity_on_its_own_period():
    config = DESLOCConfig(inner_steps=1, first_moment_rounds=2, second_moment_rounds=3)
    _, replicas = _replicas(DESLOC, config, weights=[1.0, 3.0], first=[0.2, 0.4], second=[1.0, 3.0])
    await _sync_all(replicas, 1)  # round 1: x only
    assert [m.weight.item() for m, _, _ in replicas] == [2.0, 2.0]
    assert _state(replicas, "exp_avg") == pytest.approx([0.2, 0.4])
    assert _state(replicas, "exp_avg_sq") == [1.0, 3.0]
    await _sync_all(replicas, 2)  # round 2: x and u
    assert _state(replicas, "exp_avg") == pytest.approx([0.3, 0.3])
    assert _state(replicas, "exp_avg_sq") == [1.0, 3.0]
    for model, opt, _ in replicas:  # the workers drift apart again
        with torch.no_grad():
            model.weight.add_(1.0 if model is replicas[0][0] else -1.0)
        opt.state[model.weight]["exp_avg_sq"].mul_(2.0)
    await _sync_all(replicas, 3)  # round 3: x and v
    assert [m.weight.item() for m, _, _ in replicas] == [2.0, 2.0]
    assert _state(replicas, "exp_avg_sq") == [4.0, 4.0]  # mean of 2 and 6


async def test_local_adam_averages_all_three_every_round_and_sends_twice_desloc():
    sent = {}
    for cls, config in ((LocalAdam, LocalAdamConfig(inner_steps=1)), (DESLOC, DESLOCConfig(inner_steps=1))):
        group, replicas = _replicas(cls, config, weights=[1.0, 3.0], first=[0.2, 0.4], second=[1.0, 3.0])
        for step in range(1, 7):
            await _sync_all(replicas, step)
            if cls is LocalAdam and step == 1:
                assert _state(replicas, "exp_avg") == pytest.approx([0.3, 0.3])
                assert _state(replicas, "exp_avg_sq") == [2.0, 2.0]
        sent[cls.name] = group.bytes_sent["p0"]
    # 6 rounds: Local Adam 18 tensors, DES-LOC 6 + 2 + 1 = 9
    assert sent["local_adam"] == 2 * sent["desloc"] > 0


def _hand_adam(x, u, v, g, t, lr=0.1, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    """One AdamW step by the textbook formulas."""
    x = x * (1 - lr * wd)
    u = b1 * u + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    x = x - lr * (u / (1 - b1**t)) / ((v / (1 - b2**t)) ** 0.5 + eps)
    return x, u, v


async def test_two_workers_follow_the_papers_rule_step_by_step():
    """Quadratic losses ½(x − c_m)² with c = (1, −1): after each AdamW step each quantity is
    replaced by the mean on its period (K_x 1, K_u 2, K_v 4), checked against hand-computed Adam."""
    config = DESLOCConfig(inner_steps=1, first_moment_rounds=2, second_moment_rounds=4)
    targets = [1.0, -1.0]
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    models = [scalar_model(0.5) for _ in peers]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]
    strategies = [DESLOC(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
                  for m, p in zip(models, peers, strict=True)]
    for s, o in zip(strategies, optimizers, strict=True):
        s.attach_inner_optimizer(o)
    hand = [[0.5, 0.0, 0.0] for _ in peers]
    for step in range(1, 9):
        for i, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            opt.zero_grad()
            (0.5 * (model.weight - targets[i]) ** 2).sum().backward()
            opt.step()
            x, u, v = hand[i]
            hand[i] = list(_hand_adam(x, u, v, x - targets[i], step))
        async with trio.open_nursery() as nursery:
            for s in strategies:
                nursery.start_soon(s.after_inner_step, step)
        for k, period in ((0, 1), (1, 2), (2, 4)):
            if step % period == 0:
                mean = sum(h[k] for h in hand) / 2
                for h in hand:
                    h[k] = mean
        for i, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            state = opt.state[model.weight]
            got = [model.weight.item(), state["exp_avg"].item(), state["exp_avg_sq"].item()]
            assert got == pytest.approx(hand[i], rel=1e-5, abs=1e-7), (step, i)


async def test_replicas_agree_and_a_fresh_replica_adopts_params_and_moments():
    config = DESLOCConfig(inner_steps=1, first_moment_rounds=1, second_moment_rounds=2)
    _, replicas = _replicas(DESLOC, config, weights=[1.0, 3.0], first=[0.2, 0.4], second=[1.0, 3.0])
    await _sync_all(replicas, 1)
    await _sync_all(replicas, 2)
    states = [s.outer_state_dict() for _, _, s in replicas]
    assert all(torch.equal(states[0][q]["weight"], states[1][q]["weight"]) for q in ("params", "exp_avg", "exp_avg_sq"))
    assert states[0]["completed_rounds"] == 2
    assert states[0]["adam_step"] == 2
    joiner = scalar_model(-5.0)
    strategy = DESLOC(joiner, collective=InMemoryCollectiveGroup(["j"]).member("j"), groups=FixedGroups(["j"]),
                      config=config)
    strategy.load_outer_state_dict(states[0])  # before its optimizer exists: applied on attach
    assert joiner.weight.item() == 2.0
    optimizer = torch.optim.AdamW(joiner.parameters(), lr=0.1, fused=True)
    strategy.attach_inner_optimizer(optimizer)
    state = optimizer.state[joiner.weight]
    assert state["exp_avg"].item() == pytest.approx(0.3)
    assert state["exp_avg_sq"].item() == pytest.approx(2.0)
    assert state["step"].item() == 2.0
    joiner.weight.grad = torch.ones_like(joiner.weight)
    optimizer.step()  # AdamW takes the adopted state as its own
    assert state["step"].item() == 3.0


async def test_gossip_pairs_average_inside_their_group():
    config = LocalAdamConfig(inner_steps=1, averaging="gossip", group_size=2)
    _, replicas = _replicas(LocalAdam, config, weights=[1.0, 3.0], first=[0.2, 0.4], second=[1.0, 3.0])
    assert not replicas[0][2].replicas_agree
    assert LocalAdam.averages_in_groups(config)
    reports = await _sync_all(replicas, 1)
    assert [m.weight.item() for m, _, _ in replicas] == [2.0, 2.0]
    assert _state(replicas, "exp_avg_sq") == [2.0, 2.0]
    assert reports[0][0].consensus_distance == pytest.approx(0.5)


def test_run_settings_reach_the_config():
    config = strategy_config(TrainSettings(strategy="desloc", inner_steps=20, averaging="gossip"))
    assert isinstance(config, DESLOCConfig)
    assert config.periods == {"params": 20, "exp_avg": 60, "exp_avg_sq": 120}
    assert config.averaging == "gossip"
    with pytest.raises(ConfigError, match="outer_lr"):
        strategy_config(TrainSettings(strategy="local_adam", outer_lr=0.5))
    model = scalar_model()
    made = create_strategy("local_adam", model, collective=InMemoryCollectiveGroup(["a"]).member("a"),
                           groups=FixedGroups(["a"]))
    assert isinstance(made, LocalAdam)
