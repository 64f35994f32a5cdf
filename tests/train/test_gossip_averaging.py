"""Gossip averaging for DiLoCo: pure helpers and replicas on the in-memory collective."""

from __future__ import annotations

import pytest
import torch
import trio

from lattica.coordination.groups import draw_step_groups
from lattica.errors import LocalProtocolError
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.strategies.gossip import consensus_distance, group_mean
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_consensus_distance_relative_to_the_mean_norm() -> None:
    own = [torch.tensor([3.0, 0.0]), torch.tensor([0.0])]
    mean = [torch.tensor([0.0, 4.0]), torch.tensor([0.0])]
    assert consensus_distance(own, mean) == pytest.approx(5.0 / 4.0)  # ‖(3,−4,0)‖ / ‖(0,4,0)‖
    assert consensus_distance(mean, mean) == 0.0
    assert consensus_distance(own, [torch.zeros(2), torch.zeros(1)]) == 0.0


def test_group_mean_sums_in_fp32() -> None:
    a = [torch.tensor([1.0], dtype=torch.float16)]
    b = [torch.tensor([2.0], dtype=torch.float16)]
    (mean,) = group_mean([a, b])
    assert mean.dtype == torch.float16
    assert float(mean) == 1.5


def _replicas(peers, values, config, *, groups=None):
    collective = InMemoryCollectiveGroup(peers)
    models = [scalar_model(v) for v in values]
    provider = groups or FixedGroups(peers)
    strategies = [
        DiLoCo(m, collective=collective.member(p), groups=provider, config=config)
        for m, p in zip(models, peers, strict=True)
    ]
    return collective, models, strategies


async def _train(models, strategies, *, rounds, drift, skip=()):
    """Every replica's reports, in order."""
    reports = [[] for _ in models]

    async def replica(i):
        for step in range(1, rounds + 1):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            if i not in skip:
                reports[i] += await strategies[i].after_inner_step(step)

    async with trio.open_nursery() as nursery:
        for i in range(len(models)):
            nursery.start_soon(replica, i)
    return reports


async def test_pair_averages_outer_weights_and_steps_on_the_mean_delta() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=0.5, outer_momentum=0.0, averaging="gossip", group_size=2)
    peers = ["a", "b"]
    collective, models, strategies = _replicas(peers, [0.0, 2.0], cfg)
    assert [s.replicas_agree for s in strategies] == [False, False]
    reports = await _train(models, strategies, rounds=1, drift=[1.0, 3.0])
    # φ = (0, 2) -> mean 1; θ = (1, 5): Δ = (−1, −3), mean −2; φ = 1 − 0.5·(−2) = 2
    for m in models:
        torch.testing.assert_close(m.weight, torch.tensor([[2.0]]))
    # before averaging each φ was 1 away from the group mean 1
    assert [r[-1].consensus_distance for r in reports] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert collective.bytes_sent == {"a": 8, "b": 8}  # φ and Δ, 4 bytes each, to one partner


async def test_four_replicas_average_only_inside_their_stripes() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip", group_size=2)
    peers = ["a", "b", "c", "d"]
    values = [0.0, 1.0, 10.0, 100.0]  # every pairing has two different means
    _collective, models, strategies = _replicas(peers, values, cfg)
    await _train(models, strategies, rounds=1, drift=[0.0] * 4)  # Δ = 0: only φ is averaged
    stripes = draw_step_groups(peers, key="round/0", group_size=2)
    for stripe in stripes:
        expected = sum(values[peers.index(p)] for p in stripe) / len(stripe)
        for p in stripe:
            torch.testing.assert_close(models[peers.index(p)].weight, torch.tensor([[expected]]))
    assert len({float(m.weight.detach()) for m in models}) == 2  # not the global mean: replicas differ


async def test_spread_shrinks_over_rounds_of_changing_groups() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip", group_size=2)
    peers = [f"p{i}" for i in range(8)]
    values = [float(i) for i in range(8)]
    _, models, strategies = _replicas(peers, values, cfg)

    def spread() -> float:
        w = torch.tensor([float(m.weight.detach()) for m in models])
        return float((w - w.mean()).norm())

    before = spread()
    await _train(models, strategies, rounds=6, drift=[0.0] * 8)
    assert spread() < before / 4  # groups redrawn every round mix the swarm
    mean = sum(values) / len(values)
    assert sum(float(m.weight.detach()) for m in models) / 8 == pytest.approx(mean)  # pairwise means keep the sum


async def test_a_silent_partner_is_left_out_and_the_replica_steps_alone() -> None:
    cfg = DiLoCoConfig(
        inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip", group_size=2,
        exchange_timeout_s=0.5,
    )
    peers = ["a", "b"]
    _, models, strategies = _replicas(peers, [0.0, 4.0], cfg)
    with trio.fail_after(5):
        reports = await _train(models, strategies, rounds=1, drift=[1.0, 0.0], skip={1})
    # a steps alone on its own Δ = −1: φ = 0 − (−1) = 1
    torch.testing.assert_close(models[0].weight, torch.tensor([[1.0]]))
    assert strategies[0].completed_rounds == 1
    assert reports[0][-1].consensus_distance is None  # nothing to compare with yet


def test_averaging_is_validated() -> None:
    with pytest.raises(ValueError, match="averaging"):
        DiLoCoConfig(averaging="ring")
    with pytest.raises(ValueError, match="group_size"):
        DiLoCoConfig(averaging="gossip", group_size=1)


def test_allreduce_stays_the_default_and_agrees() -> None:
    strategy = DiLoCo(
        scalar_model(0.0), collective=InMemoryCollectiveGroup(["a"]).member("a"), groups=FixedGroups(["a"]),
    )
    assert strategy.config.averaging == "allreduce"
    assert strategy.replicas_agree


def test_gossip_steps_with_noloco_momentum_unless_set() -> None:
    """A small group's mean Δ is noisier than the global one: gossip takes NoLoCo's μ 0.5."""
    assert DiLoCoConfig().outer_momentum == 0.9
    assert DiLoCoConfig(averaging="gossip").outer_momentum == 0.5
    assert DiLoCoConfig(averaging="gossip", outer_momentum=0.8).outer_momentum == 0.8
    assert DiLoCoConfig(outer_momentum=0.0).momentum == 0.0
    model = scalar_model(0.0)
    strategy = DiLoCo(model, collective=InMemoryCollectiveGroup(["a"]).member("a"), groups=FixedGroups(["a"]),
                      config=DiLoCoConfig(averaging="gossip"))
    assert strategy.outer_optimizer.param_groups[0]["momentum"] == 0.5


# -- overlapped gossip: round t's exchange runs during round t+1's inner phase -------------------


async def _train_overlapped(models, strategies, *, rounds, drift, skip=()):
    """``_train`` with a nursery bound for the exchanges in flight, and ``finish`` at the end."""
    async with trio.open_nursery() as flights:
        for s in strategies:
            s.bind_nursery(flights)
        reports = await _train(models, strategies, rounds=rounds, drift=drift, skip=skip)

        async def finish(i):
            if i not in skip:
                reports[i] += await strategies[i].finish()

        async with trio.open_nursery() as nursery:
            for i in range(len(strategies)):
                nursery.start_soon(finish, i)
    return reports


async def test_overlapped_pair_lands_each_round_one_sync_late() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=0.5, outer_momentum=0.0, averaging="gossip", overlap=True)
    _, models, strategies = _replicas(["a", "b"], [0.0, 2.0], cfg)
    seen = []
    original = strategies[0].sync

    async def sync_and_look():
        report = await original()
        seen.append((report.key, report.skipped, float(models[0].weight.detach()),
                     float(strategies[0].outer_parameters()[0].detach())))
        return report

    strategies[0].sync = sync_and_look
    reports = await _train_overlapped(models, strategies, rounds=2, drift=[1.0, 3.0])
    # round 1: Δ = (−1, −3), nothing lands; a starts from its own look-ahead 0 − 0.5·(−1) = 0.5, φ stays 0
    # round 2: θ_a = 1.5, Δ_a = −1; round 1 lands: φ = mean(0, 2) = 1, step on mean Δ −2: φ = 2;
    # a starts round 3 from 2 − 0.5·(−1) = 2.5
    assert seen == [("round/0", True, 0.5, 0.0), ("round/0", False, 2.5, 2.0)]
    # finish lands round 2 (φ = mean(2, 2), mean Δ −2): φ = θ = 3 on both, as gossip without overlap
    for m, s in zip(models, strategies, strict=True):
        torch.testing.assert_close(m.weight, torch.tensor([[3.0]]))
        assert s.completed_rounds == 2
    assert reports[0][-1].consensus_distance == pytest.approx(0.0)  # round 2's φ were already agreed


async def test_overlapped_and_blocking_gossip_reach_the_same_weights_on_a_linear_drift() -> None:
    base = {"inner_steps": 1, "outer_lr": 0.7, "outer_momentum": 0.0, "averaging": "gossip"}
    peers = [f"p{i}" for i in range(4)]
    values, drift = [0.0, 1.0, 5.0, 9.0], [0.5, -0.5, 1.0, 0.0]
    finals = []
    for overlap in (False, True):
        _, models, strategies = _replicas(peers, values, DiLoCoConfig(**base, overlap=overlap))
        await (_train_overlapped if overlap else _train)(models, strategies, rounds=5, drift=drift)
        finals.append([float(m.weight.detach()) for m in models])
    # a constant drift and μ 0: the look-ahead start plus one round late is the same recursion
    assert finals[1] == pytest.approx(finals[0])


async def test_overlapped_spread_shrinks_and_keeps_the_sum() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip", overlap=True)
    peers = [f"p{i}" for i in range(8)]
    values = [float(i) for i in range(8)]
    _, models, strategies = _replicas(peers, values, cfg)
    await _train_overlapped(models, strategies, rounds=6, drift=[0.0] * 8)
    w = torch.tensor([float(m.weight.detach()) for m in models])
    before = torch.tensor(values)
    assert float((w - w.mean()).norm()) < float((before - before.mean()).norm()) / 4
    assert float(w.mean()) == pytest.approx(float(before.mean()))


async def test_overlapped_silent_partner_costs_its_timeout_once_and_the_replica_steps_alone() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip", overlap=True,
                       exchange_timeout_s=0.5)
    _, models, strategies = _replicas(["a", "b"], [0.0, 4.0], cfg)
    reports = []
    original = strategies[0].sync

    async def sync_and_keep():
        reports.append(await original())
        return reports[-1]

    strategies[0].sync = sync_and_keep
    with trio.fail_after(5):
        await _train_overlapped(models, strategies, rounds=2, drift=[1.0, 0.0], skip={1})
    # round 1 lands alone at round 2 (Δ −1: φ = 1), round 2 at finish (Δ −1: φ = 2)
    assert reports[1].group == ("a",)
    assert reports[1].detail == "no answer from: b"
    torch.testing.assert_close(models[0].weight, torch.tensor([[2.0]]))
    assert strategies[0].completed_rounds == 2


def test_overlap_needs_gossip_and_a_nursery() -> None:
    with pytest.raises(ValueError, match="overlap"):
        DiLoCoConfig(overlap=True)
    strategy = DiLoCo(scalar_model(0.0), collective=InMemoryCollectiveGroup(["a"]).member("a"),
                      groups=FixedGroups(["a"]), config=DiLoCoConfig(averaging="gossip", overlap=True))
    with pytest.raises(LocalProtocolError, match="bind_nursery"):
        trio.run(strategy.after_inner_step, strategy.config.inner_steps)
