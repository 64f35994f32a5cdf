import pytest
import torch
import trio

from lattica.train.strategies.noloco import (
    NoLoCo,
    NoLoCoConfig,
    draw_groups,
    noloco_outer_step,
    round_seed,
)
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_outer_step_matches_hand_computation():
    phi, v = [torch.tensor([1.0])], [torch.tensor([0.2])]
    noloco_outer_step(
        phi, v, [torch.tensor([0.4])], [torch.tensor([0.8])], lr=0.5, momentum=0.5, gamma=0.25
    )
    # v = 0.5*0.2 - 0.5*0.4 - 0.25*(1.0 - 0.8) = -0.15 ; phi = 1.0 - 0.15
    torch.testing.assert_close(v[0], torch.tensor([-0.15]))
    torch.testing.assert_close(phi[0], torch.tensor([0.85]))


def test_groups_agree_whatever_order_members_arrive_in():
    members = [f"p{i}" for i in range(7)]
    a = draw_groups(members, round_number=3, group_size=2)
    b = draw_groups(list(reversed(members)), round_number=3, group_size=2)
    assert a == b
    assert sorted(q for g in a for q in g) == sorted(members)
    assert sorted(len(g) for g in a) == [2, 2, 3]  # the lone leftover joins a stripe


def test_groups_change_between_rounds_and_with_membership():
    members = [f"p{i}" for i in range(8)]
    drawn = {tuple(draw_groups(members, round_number=r, group_size=2)) for r in range(10)}
    assert len(drawn) > 1
    assert round_seed(1, members) != round_seed(1, members[:-1])


async def run_replicas(models, group, strategies, *, rounds, inner_steps, drift):
    async def replica(i):
        for step in range(1, rounds * inner_steps + 1):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            await strategies[i].after_inner_step(step)

    async with trio.open_nursery() as nursery:
        for i in range(len(models)):
            nursery.start_soon(replica, i)


def make(peers, values, config):
    group = InMemoryCollectiveGroup(peers)
    models = [scalar_model(v) for v in values]
    strategies = [
        NoLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
        for m, p in zip(models, peers, strict=True)
    ]
    return group, models, strategies


async def test_pair_applies_group_mean_with_momentum_over_rounds():
    cfg = NoLoCoConfig(inner_steps=1, outer_lr=0.7, momentum=0.5, gamma=0.7)
    group, models, strategies = make(["a", "b"], [0.0, 0.0], cfg)
    await run_replicas(models, group, strategies, rounds=2, inner_steps=1, drift=[1.0, 3.0])
    # round 1: Δ = (-1, -3), mean -2, φ equal -> δ = 1.4, φ = 1.4
    # round 2: same drift -> δ = 0.5*1.4 + 1.4 = 2.1, φ = 3.5
    for m in models:
        torch.testing.assert_close(m.weight, torch.tensor([[3.5]]))
    assert [s.completed_rounds for s in strategies] == [2, 2]
    # each round each node sends φ and Δ (4 bytes each) to its one partner
    assert group.bytes_sent == {"a": 16, "b": 16}
    assert strategies[0].traffic.peak_sync_bytes == 8


async def test_gamma_pulls_diverged_outer_weights_together():
    cfg = NoLoCoConfig(inner_steps=1, gamma=0.7)
    group, models, strategies = make(["a", "b"], [0.0, 2.0], cfg)
    await run_replicas(models, group, strategies, rounds=1, inner_steps=1, drift=[0.0, 0.0])
    # Δ = 0; mean φ = 1; δ_a = -0.7 (0 - 1) = 0.7, δ_b = -0.7 (2 - 1) = -0.7
    torch.testing.assert_close(models[0].weight, torch.tensor([[0.7]]))
    torch.testing.assert_close(models[1].weight, torch.tensor([[1.3]]))


async def test_four_replicas_three_rounds_use_no_allreduce_and_shrink_spread():
    peers = ["a", "b", "c", "d"]
    cfg = NoLoCoConfig(inner_steps=2, momentum=0.0, outer_lr=1.0, gamma=0.5)
    group, models, strategies = make(peers, [0.0, 4.0, 8.0, 12.0], cfg)

    async def no_allreduce(*args, **kwargs):
        raise AssertionError("NoLoCo must not all-reduce")

    for p in peers:
        group.member(p).allreduce = no_allreduce
    await run_replicas(models, group, strategies, rounds=3, inner_steps=2, drift=[0.0] * 4)
    values = [m.weight.item() for m in models]
    assert all(s.completed_rounds == 3 for s in strategies)
    # gossip keeps the sum and contracts the spread (no momentum, no drift)
    assert sum(values) == pytest.approx(24.0)
    assert max(values) - min(values) < 12.0 * 0.5


async def test_dead_partner_is_left_out_without_stalling_the_others():
    peers = ["a", "b", "c", "d"]
    cfg = NoLoCoConfig(inner_steps=1, momentum=0.0, outer_lr=1.0, gamma=0.0)
    group, models, strategies = make(peers, [0.0] * 4, cfg)
    stripes = draw_groups(peers, round_number=1, group_size=2)
    dead = stripes[0][0]
    partner = stripes[0][1]
    group.fail(dead)
    alive = [i for i, p in enumerate(peers) if p != dead]
    reports = {}

    async def replica(i):
        with torch.no_grad():
            models[i].weight.add_(float(i + 1))
        reports[peers[i]] = await strategies[i].after_inner_step(1)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in alive:
                nursery.start_soon(replica, i)
    solo = reports[partner][0]
    assert solo.skipped
    assert dead in solo.detail
    # the partner stepped on its own Δ: φ ← 0 - 1·(0 - θ) = θ
    i = peers.index(partner)
    torch.testing.assert_close(models[i].weight, torch.tensor([[float(i + 1)]]))
    others = [peers.index(p) for p in stripes[1]]
    mean = sum(i + 1.0 for i in others) / 2
    for i in others:
        assert not reports[peers[i]][0].skipped
        torch.testing.assert_close(models[i].weight, torch.tensor([[mean]]))


async def test_silent_partner_times_out(autojump_clock):
    cfg = NoLoCoConfig(inner_steps=1, exchange_timeout_s=10.0)
    _group, _models, strategies = make(["a", "b"], [0.0, 0.0], cfg)
    with trio.fail_after(11):
        [report] = await strategies[0].after_inner_step(1)
    assert report.skipped
    assert "b" in report.detail
