import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import create_strategy
from lattica.train.strategies.streaming import StreamingDiLoCo, StreamingDiLoCoConfig
from lattica.train.strategies.streaming_eager import StreamingEagerConfig, StreamingEagerDiLoCo
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup


class TwoScalarBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2))
        with torch.no_grad():
            for b in self.blocks:
                b.weight.zero_()


async def on_trio(models, strategies, steps, drift):
    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in models[i].parameters():
                    p.add_(drift[i])
            await strategies[i].after_inner_step(step)
        await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(len(models)):
            nursery.start_soon(replica, i, nursery)


async def in_worker_thread(models, strategies, steps, drift):
    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in models[i].parameters():
                    p.add_(drift[i])
            await trio.to_thread.run_sync(strategies[i].sync_in_thread, step)
        await strategies[i].finish()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(len(models)):
                nursery.start_soon(replica, i, nursery)


def _pair(config, peers=("a", "b")):
    group = InMemoryCollectiveGroup(list(peers))
    models = [TwoScalarBlocks() for _ in peers]
    strategies = [
        StreamingEagerDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=config)
        for m, p in zip(models, peers, strict=True)
    ]
    return group, models, strategies


@pytest.mark.parametrize("runner", [on_trio, in_worker_thread])
async def test_two_workers_match_hand_computed_eager_fragment_trajectories(runner):
    cfg = StreamingEagerConfig(
        inner_steps=2, fragments=2, outer_lr=1.0, outer_momentum=0.5, codec="fp32"
    )
    _, models, strategies = _pair(cfg)
    await runner(models, strategies, steps=4, drift=[1.0, 3.0])
    # fragment 0 (block 0) syncs at 2 and 4, fragment 1 at 3; η 1, μ 0.5
    # step 2: Δ₀ = (-2, -6); restart at 0 − 1.5·Δ₀                        -> (3, 9)
    # step 3: Δ₁ = (-3, -9); restart                                       -> (4.5, 13.5)
    # step 4: θ₀ = (5, 15), Δ₀ = (-2, -6); mean of step 2 = -4: b₀ = -4, θ̃₀ = 6;
    #         restart at 6 − (Δ₀ + 0.5·(0.5·-4 + Δ₀))                      -> (10, 16)
    # finish: fragment 1, mean -6: b₁ = -6, θ̃₁ = 9; fragment 0, mean -4: b₀ = -6,
    #         θ̃₀ = 6 − (-4 − 3) = 13 — per-fragment blocking DiLoCo's weights; θ ← θ̃
    for m in models:
        assert [p.item() for p in m.parameters()] == [13.0, 9.0]
    for s in strategies:
        assert [p.item() for p in s.evaluation_parameters()] == [13.0, 9.0]
        assert s.traffic.syncs == 3
    assert strategies[0].completed_rounds == 1  # 3 fragment syncs = 1.5 full rounds


async def test_replicas_differ_while_training_and_end_identical():
    peers = ["a", "b", "c"]
    group = InMemoryCollectiveGroup(peers)
    cfg = StreamingEagerConfig(inner_steps=4, fragments=2)  # fp4 fragments
    gpt = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
    models = [build_model(gpt, seed=0) for _ in peers]
    strategies = [
        StreamingEagerDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    assert not any(s.replicas_agree for s in strategies)
    drift = [0.01, -0.02, 0.03]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in range(1, 13):
            with torch.no_grad():
                for p in models[i].parameters():
                    p.add_(drift[i])
            await strategies[i].after_inner_step(step)
        live = [p.detach().clone() for p in models[i].parameters()]
        await strategies[i].finish()
        return live

    lives = [None] * 3

    async def keep(i, nursery):
        lives[i] = await replica(i, nursery)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(keep, i, nursery)
    # before finish each worker trained from its own look-ahead
    assert not all(torch.equal(x, y) for x, y in zip(lives[0], lives[1], strict=True))
    finals = [list(m.parameters()) for m in models]
    for other in finals[1:]:
        assert all(torch.equal(x, y) for x, y in zip(finals[0], other, strict=True))
    assert all(s.traffic.syncs == 5 for s in strategies)


async def test_a_failed_fragment_sync_applies_the_own_pseudo_gradient_without_stalling():
    cfg = StreamingEagerConfig(
        inner_steps=2, fragments=2, outer_lr=1.0, outer_momentum=0.5, codec="fp32"
    )
    group, [model, _], [strategy, _] = _pair(cfg)
    group.fail("b")
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            strategy.bind_nursery(nursery)
            reports = []
            for step in range(1, 5):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                reports += await strategy.after_inner_step(step)
    assert [r.skipped for r in reports] == [True]  # fragment 0's sync of step 2, applied at 4
    # its own Δ₀ = -2 stands: b₀ = -2, θ̃₀ = 0 − (-2 − 1) = 3
    assert next(iter(strategy.evaluation_parameters())).item() == 3.0


def test_reachable_by_name_from_the_run_settings():
    settings = TrainSettings(strategy="streaming_eager", inner_steps=50, outer_momentum=0.9)
    config = strategy_config(settings)
    assert isinstance(config, StreamingEagerConfig)
    assert config.eager
    assert config.inner_steps == 50
    group = InMemoryCollectiveGroup(["a"])
    strategy = create_strategy(
        "streaming_eager", TwoScalarBlocks(), collective=group.member("a"),
        groups=FixedGroups(["a"]), config=config,
    )
    assert isinstance(strategy, StreamingEagerDiLoCo)
    with pytest.raises(ValueError, match="always eager"):
        StreamingEagerConfig(eager=False)
    # the plain strategy is unchanged: replicas agree, not eager
    plain = StreamingDiLoCo(
        TwoScalarBlocks(), collective=group.member("a"), groups=FixedGroups(["a"]),
        config=StreamingDiLoCoConfig(inner_steps=4),
    )
    assert plain.replicas_agree
