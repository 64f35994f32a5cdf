import torch
import trio

from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.strategies.eager import EagerDiLoCo, EagerDiLoCoConfig
from lattica.train.strategies.outer_math import eager_start
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_eager_start_is_the_nesterov_step_without_changing_the_shared_state():
    phi, buf, delta = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5)
    # b' = 0.5·2 + 0.5 = 1.5; s = 1 − 0.5·(0.5 + 0.5·1.5) = 0.375
    [start] = eager_start([phi], [buf], [delta], lr=0.5, momentum_factor=0.5)
    torch.testing.assert_close(start, torch.tensor(0.375))
    assert phi.item() == 1.0
    assert buf.item() == 2.0
    # before the first outer step b' = Δ: s = 1 − 0.5·(0.5 + 0.25) = 0.625
    [first] = eager_start([phi], [None], [delta], lr=0.5, momentum_factor=0.5)
    torch.testing.assert_close(first, torch.tensor(0.625))


def test_eager_start_equals_what_torch_sgd_nesterov_would_step_to():
    torch.manual_seed(0)
    phi, buf, delta = torch.randn(5), torch.randn(5), torch.randn(5)
    [start] = eager_start([phi], [buf], [delta], lr=0.7, momentum_factor=0.9)
    param = phi.clone().requires_grad_()
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    sgd.state[param]["momentum_buffer"] = buf.clone()
    param.grad = delta.clone()
    sgd.step()
    torch.testing.assert_close(start, param.detach())


async def _run(strategy_cls, config, drift, rounds):
    """Replicas of a one-weight model whose inner phase adds ``drift[i]`` per step."""
    peers = [chr(ord("a") + i) for i in range(len(drift))]
    group = InMemoryCollectiveGroup(peers)
    models = [scalar_model() for _ in peers]
    strategies = [
        strategy_cls(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
        for m, p in zip(models, peers, strict=True)
    ]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, rounds + 1):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            await strategies[i].after_inner_step(step)
        await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            nursery.start_soon(replica, i, nursery)
    return [m.weight.item() for m in models], strategies


async def test_two_replicas_match_hand_computed_trajectory():
    cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.5)
    weights, strategies = await _run(EagerDiLoCo, cfg, drift=[1.0, 3.0], rounds=2)
    # step 1: Δ = (-1, -3); nothing to apply yet; s = 0 − (Δ + 0.5·Δ)          -> s = (1.5, 4.5)
    # step 2: θ = (2.5, 7.5), Δ = (-1, -3); mean₁ = -2: b = -2, φ = 0 − (-2 − 1) = 3
    #         s = 3 − (Δ + 0.5·(0.5·-2 + Δ))                                   -> s = (5, 8)
    # finish: mean₂ = -2: b = 0.5·-2 − 2 = -3; φ = 3 − (-2 − 1.5) = 6.5; θ ← φ on both
    assert weights == [6.5, 6.5]
    assert [s.completed_rounds for s in strategies] == [2, 2]


async def test_ends_at_diloco_weights_when_progress_does_not_depend_on_the_start():
    # the defect this guards against: the per-worker formula Δ^{t−1} + (Δ_m^t − Δ_m^{t−1})/M fed
    # the others' progress into the outer step one round late, so it ended elsewhere (here
    # 6.6875 / 7.0625 instead of 6.5) and oscillated with μ = 0.9
    for momentum in (0.5, 0.9):
        eager_cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=0.7, outer_momentum=momentum)
        diloco_cfg = DiLoCoConfig(inner_steps=1, outer_lr=0.7, outer_momentum=momentum)
        drift = [1.0, -2.0, 0.5, 4.0]
        eager, _ = await _run(EagerDiLoCo, eager_cfg, drift=drift, rounds=5)
        diloco, _ = await _run(DiLoCo, diloco_cfg, drift=drift, rounds=5)
        for value in eager:
            assert abs(value - diloco[0]) < 1e-4 * max(1.0, abs(diloco[0]))


class QuadraticPull:
    """An inner phase that moves the weight a fraction ``pull`` of the way to ``target``."""

    def __init__(self, model, target, pull):
        self.model, self.target, self.pull = model, target, pull

    def step(self):
        with torch.no_grad():
            w = self.model.weight
            w.sub_(self.pull * (w - self.target))


async def test_momentum_0_9_converges_where_a_one_round_stale_gradient_diverges():
    # 4 workers, each inner phase covers 80 % of the way to its own optimum (mean 0): with
    # η 0.7, μ 0.9 a delayed outer gradient oscillates with a growing amplitude; DiLoCo and
    # eager converge to the mean optimum
    peers = ["a", "b", "c", "d"]
    targets = [1.0, -1.0, 0.5, -0.5]
    group = InMemoryCollectiveGroup(peers)
    cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=0.7, outer_momentum=0.9)
    models = [scalar_model(10.0) for _ in peers]
    strategies = [
        EagerDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    pulls = [QuadraticPull(m, t, 0.8) for m, t in zip(models, targets, strict=True)]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, 61):
            pulls[i].step()
            await strategies[i].after_inner_step(step)
        await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(replica, i, nursery)
    for m in models:
        assert abs(m.weight.item()) < 1e-2  # started at 10


class GatedCollective:
    """Delegates to an in-memory member, but holds every all-reduce until ``release`` is set."""

    def __init__(self, inner, release):
        self.inner, self.release = inner, release
        self.peer_id = inner.peer_id

    async def allreduce(self, tensors, **kwargs):
        await self.release.wait()
        return await self.inner.allreduce(tensors, **kwargs)


async def test_inner_steps_continue_while_the_average_is_in_flight():
    peers = ["a", "b", "c"]
    group = InMemoryCollectiveGroup(peers)
    release = trio.Event()
    cfg = EagerDiLoCoConfig(inner_steps=2)
    models = [scalar_model() for _ in range(3)]
    strategies = [
        EagerDiLoCo(
            m,
            collective=GatedCollective(group.member(p), release),
            groups=FixedGroups(peers),
            config=cfg,
        )
        for m, p in zip(models, peers, strict=True)
    ]
    progress = [0, 0, 0]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, 7):
            with torch.no_grad():
                models[i].weight.add_(float(i))
            await strategies[i].after_inner_step(step)
            progress[i] = step
        await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(replica, i, nursery)
        await trio.testing.wait_all_tasks_blocked()
        # round 1's mean is held back, yet everyone ran all of round 2 and waits only at its end
        assert progress == [3, 3, 3]
        release.set()
    assert all(s.completed_rounds == 3 for s in strategies)
    values = [m.weight.item() for m in models]
    # every replica applied the same three means to the same shared state
    assert values[0] == values[1] == values[2]


async def test_failed_average_applies_own_pseudo_gradient():
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.5)
    model = scalar_model()
    strategy = EagerDiLoCo(
        model, collective=group.member("a"), groups=FixedGroups(peers), config=cfg
    )
    group.fail("b")
    async with trio.open_nursery() as nursery:
        strategy.bind_nursery(nursery)
        with torch.no_grad():
            model.weight.add_(1.0)
        await strategy.after_inner_step(1)
        torch.testing.assert_close(model.weight, torch.tensor([[1.5]]))  # s = 0 − (-1 − 0.5)
        [report] = await strategy.finish()
    assert report.skipped
    assert "b" in report.detail
    # the mean is unknown: own Δ = -1 is applied, b = -1, φ = 0 − (-1 − 0.5) = 1.5 = the start
    torch.testing.assert_close(model.weight, torch.tensor([[1.5]]))
    assert strategy.outer_state_dict()["momentum"]["weight"].item() == -1.0


class SlowGroups(FixedGroups):
    """Group agreement that, like the round coordinator, waits until the last member arrives."""

    def __init__(self, members, arrived):
        super().__init__(members)
        self.arrived = arrived

    async def group_for(self, key):
        if key != "round/1":
            await self.arrived.wait()
        return await super().group_for(key)


async def test_waiting_for_the_others_to_reach_a_round_does_not_stop_inner_steps():
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    arrived = trio.Event()
    cfg = EagerDiLoCoConfig(inner_steps=2)
    models = [scalar_model() for _ in peers]
    strategies = [
        EagerDiLoCo(m, collective=group.member(p), groups=SlowGroups(peers, arrived), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    progress = [0, 0]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, 7):
            await strategies[i].after_inner_step(step)
            progress[i] = step

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(replica, i, nursery)
        await trio.testing.wait_all_tasks_blocked()
        # round 2's group is not agreed yet, yet both ran all of round 3: they wait for round
        # 2's mean only at the end of round 3
        assert progress == [5, 5]
        arrived.set()
    assert progress == [6, 6]


async def test_outer_state_round_trips_and_restarts_the_phase_at_the_shared_weights():
    cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.5)
    _, [a, _] = await _run(EagerDiLoCo, cfg, drift=[1.0, 3.0], rounds=2)
    state = a.outer_state_dict()
    model = scalar_model()
    fresh = EagerDiLoCo(model, collective=None, groups=None, config=cfg)
    fresh.load_outer_state_dict(state)
    assert model.weight.item() == 6.5
    assert fresh.completed_rounds == 2
    assert fresh.outer_state_dict()["momentum"]["weight"].item() == -3.0
