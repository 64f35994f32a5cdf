import pytest
import torch
import trio

from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.strategies import create_strategy, strategy_class
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.strategies.outer_math import nesterov_outer_step, pseudo_gradient
from lattica_lab.collective import InMemoryCollectiveGroup

TINY = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)


class FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)
        self.asked = []

    async def group_for(self, key):
        self.asked.append(key)
        return self.members


def test_pseudo_gradient_is_outer_minus_inner():
    outer = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    inner = [torch.tensor([0.5, 2.5]), torch.tensor([[1.0]])]
    delta = pseudo_gradient(outer, inner)
    assert torch.equal(delta[0], torch.tensor([0.5, -0.5]))
    assert torch.equal(delta[1], torch.tensor([[2.0]]))


def test_nesterov_step_matches_hand_computation():
    # b1 = g1; phi1 = phi0 - lr (g1 + mu b1); b2 = mu b1 + g2; phi2 = phi1 - lr (g2 + mu b2)
    lr, mu = 0.7, 0.9
    phi = [torch.tensor([1.0], dtype=torch.float64)]
    buffers = [None]
    nesterov_outer_step(
        phi, [torch.tensor([0.5], dtype=torch.float64)], buffers, lr=lr, momentum=mu
    )
    assert phi[0].item() == pytest.approx(1.0 - 0.7 * (0.5 + 0.9 * 0.5))
    nesterov_outer_step(
        phi, [torch.tensor([-0.2], dtype=torch.float64)], buffers, lr=lr, momentum=mu
    )
    b2 = 0.9 * 0.5 - 0.2
    expected = 1.0 - 0.7 * (0.5 + 0.45) - 0.7 * (-0.2 + 0.9 * b2)
    assert phi[0].item() == pytest.approx(expected, abs=1e-12)
    assert buffers[0].item() == pytest.approx(b2, abs=1e-12)


def test_nesterov_step_is_bit_identical_to_torch_sgd():
    gen = torch.Generator().manual_seed(3)
    ours = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)]
    ref = [p.clone().requires_grad_(True) for p in ours]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    buffers = [None, None]
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        nesterov_outer_step(ours, grads, buffers, lr=0.7, momentum=0.9)
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        sgd.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b.detach())


def test_config_validation():
    with pytest.raises(ValueError, match="inner_steps"):
        DiLoCoConfig(inner_steps=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoConfig(outer_momentum=1.0)


def test_registry_knows_baselines_and_rejects_unknown():
    assert strategy_class("diloco") is DiLoCo
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy_class("nope")


def _perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


async def test_three_replicas_three_rounds_end_bit_identical():
    peers = ["a", "b", "c"]
    network = InMemoryCollectiveGroup(peers)
    models = [build_model(TINY, seed=0) for _ in peers]
    initial = [p.detach().clone() for p in models[0].parameters()]
    strategies = [
        create_strategy(
            "diloco",
            m,
            collective=network.member(p),
            groups=FixedGroups(peers),
            config=DiLoCoConfig(inner_steps=2),
        )
        for m, p in zip(models, peers, strict=True)
    ]
    deltas_seen = []
    for rnd in range(3):
        for step in (2 * rnd + 1, 2 * rnd + 2):
            for i, m in enumerate(models):
                _perturb(m, seed=100 * rnd + 10 * i + step)  # a different "inner step" each
            if step % 2 == 0:
                deltas_seen.append(
                    [
                        pseudo_gradient(s.outer_parameters(), list(m.parameters()))
                        for s, m in zip(strategies, models, strict=True)
                    ]
                )
            reports = []
            async with trio.open_nursery() as nursery:
                for s in strategies:
                    nursery.start_soon(_collect, s, step, reports)
            assert len(reports) == (3 if step % 2 == 0 else 0)
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)
    assert all(s.completed_rounds == 3 for s in strategies)
    # the same three rounds computed by hand from the recorded pseudo-gradients
    phi = [t.clone() for t in initial]
    buffers = [None] * len(phi)
    for per_replica in deltas_seen:
        mean = [sum(d[k] for d in per_replica) / 3 for k in range(len(phi))]
        nesterov_outer_step(phi, mean, buffers, lr=0.7, momentum=0.9)
    for a, b in zip(models[0].parameters(), phi, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    moved = zip(models[0].parameters(), initial, strict=True)
    assert any(not torch.equal(a.detach(), b) for a, b in moved)


async def _collect(strategy, step, out):
    out.extend(await strategy.after_inner_step(step))


async def test_dead_peer_is_left_out_and_round_completes():
    peers = ["a", "b", "c"]
    network = InMemoryCollectiveGroup(peers)

    class ShrinkingGroups(FixedGroups):
        async def group_for(self, key):
            self.asked.append(key)
            return ("a", "b") if "retry" in key else self.members

    models = [build_model(TINY, seed=0) for _ in peers[:2]]
    groups = [ShrinkingGroups(peers) for _ in peers[:2]]
    strategies = [
        DiLoCo(m, collective=network.member(p), groups=g, config=DiLoCoConfig(inner_steps=1))
        for m, p, g in zip(models, peers[:2], groups, strict=True)
    ]
    for i, m in enumerate(models):
        _perturb(m, seed=i)
    reports = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for s in strategies:
                nursery.start_soon(_collect, s, 1, reports)
            await trio.sleep(0.01)
            network.fail("c")  # c never arrived; both waiters are released
    assert [r.group for r in reports] == [("a", "b"), ("a", "b")]
    assert all(not r.skipped for r in reports)
    assert groups[0].asked == ["round/0", "round/0/retry/1"]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


async def test_round_is_skipped_when_every_attempt_fails():
    network = InMemoryCollectiveGroup(["a", "b"])
    network.fail("b")
    model = build_model(TINY, seed=0)
    _perturb(model, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    s = DiLoCo(
        model,
        collective=network.member("a"),
        groups=FixedGroups(["a", "b"]),
        config=DiLoCoConfig(inner_steps=1),
    )
    (report,) = await s.after_inner_step(1)
    assert report.skipped
    assert "unavailable" in report.detail
    assert s.completed_rounds == 0
    assert s.round == 1
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)  # the inner weights keep training untouched


async def test_outer_state_roundtrip_and_validation():
    network = InMemoryCollectiveGroup(["a"])
    model = build_model(TINY, seed=0)
    s = DiLoCo(
        model,
        collective=network.member("a"),
        groups=FixedGroups(["a"]),
        config=DiLoCoConfig(inner_steps=1),
    )
    _perturb(model, seed=2)
    await s.after_inner_step(1)
    state = s.outer_state_dict()
    assert state["round"] == 1
    assert state["step"] == 1
    assert state["momentum"]
    joiner_model = build_model(TINY, seed=9)
    joiner = DiLoCo(
        joiner_model,
        collective=network.member("a"),
        groups=FixedGroups(["a"]),
        config=DiLoCoConfig(inner_steps=1),
    )
    joiner.load_outer_state_dict(state)
    assert joiner.completed_rounds == 1
    for a, b in zip(joiner_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    bad = dict(state, params={**state["params"], "tok_emb.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        joiner.load_outer_state_dict(bad)
    with pytest.raises(ValueError, match="unknown"):
        joiner.load_outer_state_dict(dict(state, params={**state["params"], "x": torch.zeros(1)}))


async def test_single_member_group_sends_nothing():
    network = InMemoryCollectiveGroup(["a", "b"])
    model = build_model(TINY, seed=0)
    s = DiLoCo(
        model,
        collective=network.member("a"),
        groups=FixedGroups(["a"]),
        config=DiLoCoConfig(inner_steps=1),
    )
    _perturb(model, seed=2)
    (report,) = await s.after_inner_step(1)
    assert report.bytes_sent == 0
    assert network.bytes_sent["a"] == 0
    assert s.completed_rounds == 1


async def test_outer_lr_one_without_momentum_keeps_the_local_weights():
    # φ ← φ − 1·(φ − θ) = θ: a single worker with η = 1, μ = 0 is plain local training
    network = InMemoryCollectiveGroup(["a"])
    model = build_model(TINY, seed=0)
    s = DiLoCo(
        model,
        collective=network.member("a"),
        groups=FixedGroups(["a"]),
        config=DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0),
    )
    _perturb(model, seed=4)
    trained = [p.detach().clone() for p in model.parameters()]
    await s.after_inner_step(1)
    for a, b in zip(model.parameters(), trained, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)
