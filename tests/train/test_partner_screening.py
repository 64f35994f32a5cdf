"""Every averaging path screens what partners send: a hostile member in memory.

One member of each group is hostile (``PoisonedCollective``: its exchanges carry NaN, or an
update scaled far beyond the others'; or a crafted sparse payload). The honest members refuse
it and average without it — in a group of two they keep their own step — and count the refusal
against it (``partner_screen.refused``); where replicas agree (all-gathers, SPES's all-reduce)
they still agree. Without the screen each of these runs averages the NaN or the huge update.
"""

from __future__ import annotations

import math

import torch
import trio

from lattica.numerics import demo_codec, sparse
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.moe import MoEConfig, build_moe_model, dense_parameters, expert_parameters
from lattica.train.strategies import create_strategy
from lattica.train.strategies.demo_momentum import DeMoConfig
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.strategies.experts import DerivedOwnership, experts_of
from lattica.train.strategies.noloco import NoLoCo, NoLoCoConfig
from lattica.train.strategies.sparseloco import (
    SparseLoCoConfig,
    compress_with_feedback,
    flatten,
    mean_of_sparse,
)
from lattica.train.strategies.spes import SPES, SPESConfig
from lattica_lab.collective import (
    FixedGroups,
    InMemoryCollectiveGroup,
    PoisonedCollective,
    nan_like,
    scalar_model,
)


def _scaled(factor: float):
    return lambda t: t * factor


def _members(peers, hostile, poison):
    network = InMemoryCollectiveGroup(peers)
    return [
        PoisonedCollective(network.member(p), poison) if p in hostile else network.member(p) for p in peers
    ]


async def _rounds(strategies, models, *, rounds, drift, overlap=False):
    """Each replica drifts by its own amount per inner step (one step per round), then syncs;
    with ``overlap``, exchanges fly in a nursery and land at ``finish``. Each one's reports."""
    reports = [[] for _ in strategies]

    async def replica(i):
        for step in range(1, rounds + 1):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            reports[i] += await strategies[i].after_inner_step(step)
        reports[i] += await strategies[i].finish()

    async with trio.open_nursery() as flights:
        for s in strategies:
            s.bind_nursery(flights)
        async with trio.open_nursery() as nursery:
            for i in range(len(strategies)):
                nursery.start_soon(replica, i)
    return reports


def _gossip_diloco(peers, hostile, poison, *, group_size=2, overlap=False):
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=0.5, outer_momentum=0.0, averaging="gossip",
                       group_size=group_size, overlap=overlap)
    models = [scalar_model(0.0) for _ in peers]
    strategies = [
        DiLoCo(m, collective=c, groups=FixedGroups(peers), config=cfg)
        for m, c in zip(models, _members(peers, hostile, poison), strict=True)
    ]
    return models, strategies


# -- gossip DiLoCo: a pair, a group of three, overlapped ------------------------------------------


async def test_gossip_pair_keeps_its_own_step_when_the_partner_sends_nan() -> None:
    models, strategies = _gossip_diloco(["a", "b"], {"b"}, nan_like)
    reports = await _rounds(strategies, models, rounds=1, drift=[1.0, 3.0])
    # a refuses b: alone, φ = 0 − 0.5·(−1) = 0.5; b averages a's honest [φ, Δ] with its own
    torch.testing.assert_close(models[0].weight, torch.tensor([[0.5]]))
    torch.testing.assert_close(models[1].weight, torch.tensor([[1.0]]))
    assert reports[0][0].group == ("a",)
    assert reports[0][0].detail == "refused: b"
    assert strategies[0].partner_screen.refused == {"b": 1}
    assert strategies[1].partner_screen.refused == {}


async def test_gossip_pair_refuses_an_update_far_above_its_own() -> None:
    models, strategies = _gossip_diloco(["a", "b"], {"b"}, _scaled(1e6))  # b's Δ −3e6, φ 0
    await _rounds(strategies, models, rounds=2, drift=[1.0, 3.0])
    torch.testing.assert_close(models[0].weight, torch.tensor([[1.0]]))  # two steps alone
    assert strategies[0].partner_screen.refused == {"b": 2}


async def test_a_group_of_three_averages_the_honest_two_without_the_nan_member() -> None:
    models, strategies = _gossip_diloco(["a", "b", "c"], {"c"}, nan_like, group_size=3)
    await _rounds(strategies, models, rounds=1, drift=[1.0, 3.0, 5.0])
    # a and b: φ mean 0, Δ mean −2: φ = 1; c averages the three honest contributions: Δ −3
    for i in (0, 1):
        torch.testing.assert_close(models[i].weight, torch.tensor([[1.0]]))
        assert strategies[i].partner_screen.refused == {"c": 1}
    torch.testing.assert_close(models[2].weight, torch.tensor([[1.5]]))


async def test_overlapped_gossip_refuses_a_nan_partner_when_its_exchange_lands() -> None:
    models, strategies = _gossip_diloco(["a", "b"], {"b"}, nan_like, overlap=True)
    reports = await _rounds(strategies, models, rounds=2, drift=[1.0, 3.0], overlap=True)
    assert math.isfinite(float(models[0].weight.detach()))
    # both landed rounds were a's own: the same weights as two lone blocking steps (Δ −1 each)
    torch.testing.assert_close(models[0].weight, torch.tensor([[1.0]]))
    assert [r.detail for r in reports[0] if not r.skipped] == ["refused: b", "refused: b"]
    assert strategies[0].partner_screen.refused == {"b": 2}


# -- NoLoCo -----------------------------------------------------------------------------------------


async def test_noloco_steps_alone_when_its_partner_sends_nan() -> None:
    peers = ["a", "b"]
    cfg = NoLoCoConfig(inner_steps=1, outer_lr=0.5, gamma=0.7, momentum=0.0)
    models = [scalar_model(0.0) for _ in peers]
    strategies = [
        NoLoCo(m, collective=c, groups=FixedGroups(peers), config=cfg)
        for m, c in zip(models, _members(peers, {"b"}, nan_like), strict=True)
    ]
    reports = await _rounds(strategies, models, rounds=1, drift=[1.0, 3.0])
    torch.testing.assert_close(models[0].weight, torch.tensor([[0.5]]))  # δ = −0.5·(−1)
    assert reports[0][0].skipped
    assert reports[0][0].detail == "refused: b"
    assert strategies[0].partner_screen.refused == {"b": 1}
    assert math.isfinite(float(models[1].weight.detach()))


# -- SparseLoCo: gossip pairs and the all-gather ----------------------------------------------------

TINY = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)


def _sparseloco(peers, config, *, steps):
    """A replica per peer, each moved by its own random step × ``steps[i]``; the sparse update
    each one will send."""
    network = InMemoryCollectiveGroup(peers)
    strategies, sent = [], []
    for i, peer in enumerate(peers):
        model = build_model(TINY, seed=0)
        strategy = create_strategy("sparseloco", model, collective=network.member(peer),
                                   groups=FixedGroups(peers), config=config)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01 * steps[i])
        delta = flatten([o - p.detach() for o, p in zip(strategy.outer_parameters(), model.parameters(), strict=True)])
        sent.append(compress_with_feedback(strategy.error, delta, decay=config.error_decay, chunk=config.chunk,
                                           k=config.k, value_codec=config.value_codec)[0])
        strategies.append(strategy)
    return strategies, sent


async def _sync_all(strategies):
    reports = {}

    async def one(i):
        reports[i] = await strategies[i].sync()

    async with trio.open_nursery() as nursery:
        for i in range(len(strategies)):
            nursery.start_soon(one, i)
    return [reports[i] for i in range(len(strategies))]


def _theta(strategy):
    return torch.cat([p.reshape(-1) for p in strategy.outer_parameters()])


async def test_sparseloco_gossip_pair_refuses_a_diverged_partner_s_update() -> None:
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, averaging="gossip", group_size=2)
    strategies, sent = _sparseloco(["a", "b"], config, steps=[1.0, 1e4])
    theta0 = _theta(strategies[0])
    reports = await _sync_all(strategies)
    assert reports[0].group == ("a",)
    assert reports[0].detail == "refused: b"
    assert torch.equal(_theta(strategies[0]), theta0 - config.outer_lr * sparse.densify(sent[0], theta0.numel()))
    assert strategies[0].partner_screen.refused == {"b": 1}


async def test_sparseloco_gossip_refuses_a_payload_that_does_not_decode() -> None:
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, averaging="gossip", group_size=2)
    strategies, sent = _sparseloco(["a", "b"], config, steps=[1.0, 1.0])
    with torch.no_grad():
        next(strategies[1].model.parameters()).view(-1)[0] = float("nan")  # a NaN scale in b's ŝ
    theta0 = _theta(strategies[0])
    await _sync_all(strategies)
    assert torch.equal(_theta(strategies[0]), theta0 - config.outer_lr * sparse.densify(sent[0], theta0.numel()))
    assert strategies[0].partner_screen.refused == {"b": 1}


async def test_sparseloco_all_gather_leaves_out_a_diverged_member_everywhere_alike() -> None:
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05)
    strategies, sent = _sparseloco(["a", "b", "c"], config, steps=[1.0, 1.5, 1e4])
    theta0 = _theta(strategies[0])
    await _sync_all(strategies)
    expected = theta0 - config.outer_lr * mean_of_sparse(sent[:2], theta0.numel())
    for s in strategies:  # c too: every member judges the same list alike, so replicas still agree
        assert torch.equal(_theta(s), expected)
    assert [s.partner_screen.refused for s in strategies] == [{"c": 1}, {"c": 1}, {}]


# -- DeMo's all-gather --------------------------------------------------------------------------------


def _demo(peers, config):
    network = InMemoryCollectiveGroup(peers)
    strategies = []
    for peer in peers:
        model = build_model(TINY, seed=0)
        s = create_strategy("demo", model, collective=network.member(peer), groups=FixedGroups(peers), config=config)
        s.attach_inner_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        strategies.append(s)
    return network, strategies


def _grads(strategies, seed):
    for i, s in enumerate(strategies):
        gen = torch.Generator().manual_seed(seed * 10 + i)
        for p in s.model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)


async def test_demo_all_gather_leaves_out_a_member_whose_coefficients_are_huge() -> None:
    config = DeMoConfig(chunk=8, topk=4, value_codec="int8")
    network, (a, b, _) = _demo(["a", "b", "c"], config)
    _, twins = _demo(["a", "b"], config)  # the same two honest members without c
    layout = a.layout
    huge = [
        demo_codec.encode(sparse.top_k_per_chunk(torch.ones(n * layout.chunks[n]), chunk=n, k=layout.k[n]),
                          codec="int8")
        for n in layout.sizes
    ]
    huge[0][16:20] = torch.tensor([1e30], dtype=torch.float32).view(torch.uint8)  # a finite, huge scale
    c = network.member("c")
    _grads([a, b], 1)
    _grads(twins, 1)
    async with trio.open_nursery() as nursery:
        for s in (a, b, *twins):
            nursery.start_soon(s.before_optimizer_step, 1)
        for peer in ("a", "b"):
            nursery.start_soon(lambda peer=peer: c.exchange(huge, peer=peer, tag="demo/step/1/0", codec="raw"))
    for s, twin in zip((a, b), twins, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(s.model.parameters(), twin.model.parameters(), strict=True))
        assert s.partner_screen.refused == {"c": 1}


# -- SPES: gossip pairs and the all-reduce's expert copies -------------------------------------------

MOE = MoEConfig(n_layer=1, d_model=8, n_head=2, context=8, num_experts=4, top_k=2, expert_hidden=8)


def _spes(peers, hostile, config):
    members = _members(peers, hostile, nan_like)
    strategies = []
    for collective in members:
        model = build_moe_model(MOE, seed=0)
        strategies.append(SPES(model, collective=collective, groups=FixedGroups(peers), config=config,
                               ownership=DerivedOwnership(peers, MOE.num_experts)))
    return strategies


async def _spes_sync(strategies):
    async with trio.open_nursery() as nursery:
        for s in strategies:
            nursery.start_soon(s.after_inner_step, 1)


def _params(strategy):
    return [p.detach().clone() for p in strategy.model.parameters()]


async def test_spes_gossip_pair_keeps_its_weights_when_the_partner_sends_nan() -> None:
    config = SPESConfig(sync_every=1, merge_alpha=0.0, averaging="gossip", group_size=2, exchange_timeout_s=2.0)
    a, b = _spes(["a", "b"], {"b"}, config)
    with torch.no_grad():
        for p in dense_parameters(b.model):
            p.add_(1.0)  # b's honest dense weights differ: a averaging them would move
    before = _params(a)
    await _spes_sync([a, b])
    assert all(torch.equal(x, y) for x, y in zip(_params(a), before, strict=True))
    assert a.partner_screen.refused == {"b": 1}
    assert all(bool(torch.isfinite(p).all()) for p in b.model.parameters())


async def test_spes_all_reduce_keeps_the_held_copies_of_experts_sent_as_nan() -> None:
    peers = ["a", "b", "c", "d"]
    strategies = _spes(peers, {"b"}, SPESConfig(sync_every=1, merge_alpha=0.0))
    honest = [s for s, p in zip(strategies, peers, strict=True) if p != "b"]
    held = {e: [t.detach().clone() for t in expert_parameters(honest[0].model)[e]]
            for e in experts_of(honest[0].owners, "b")}
    await _spes_sync(strategies)
    reference = _params(honest[0])
    for s in honest:  # the copies every member held before: replicas still agree, all finite
        assert all(torch.equal(x, y) for x, y in zip(_params(s), reference, strict=True))
        assert all(bool(torch.isfinite(p).all()) for p in s.model.parameters())
        for e, tensors in held.items():
            assert all(torch.equal(x, y) for x, y in zip(expert_parameters(s.model)[e], tensors, strict=True))
        assert s.partner_screen.refused == {"b": 1}
