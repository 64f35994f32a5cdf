import torch
import trio

from lattica.train.strategies.eager import EagerDiLoCo, EagerDiLoCoConfig, eager_outer_gradient
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model


def test_eager_gradient_swaps_own_stale_share_for_fresh_one():
    out = eager_outer_gradient([torch.tensor(-2.0)], [torch.tensor(-5.0)], [torch.tensor(-1.0)], 4)
    # -2 + (-5 - -1) / 4 = -3
    torch.testing.assert_close(out[0], torch.tensor(-3.0))


async def test_two_replicas_match_hand_computed_trajectory():
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    cfg = EagerDiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.5)
    models = [scalar_model(), scalar_model()]
    strategies = [
        EagerDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    drift = [1.0, 3.0]

    async def replica(i, nursery):
        strategies[i].bind_nursery(nursery)
        for step in (1, 2):
            with torch.no_grad():
                models[i].weight.add_(drift[i])
            await strategies[i].after_inner_step(step)
        await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(replica, i, nursery)
    # round 1: Δ̃ = own/2 = (-0.5, -1.5); b = g; φ -= 1.5 g      -> φ = (0.75, 2.25)
    # round 2: Δ̃ = -2 + 0 = -2; b = 0.5 b - 2; φ -= g + 0.5 b    -> φ = (3.875, 5.625)
    # finish:  Δ̃ = -2 - own/2 = (-1.5, -0.5)                     -> φ = (6.6875, 7.0625)
    torch.testing.assert_close(models[0].weight, torch.tensor([[6.6875]]))
    torch.testing.assert_close(models[1].weight, torch.tensor([[7.0625]]))
    assert [s.completed_rounds for s in strategies] == [3, 3]


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
    assert all(s.completed_rounds == 4 for s in strategies)  # 3 rounds + the final catch-up
    values = [m.weight.item() for m in models]
    # without communication the replicas would end 12 apart; each applied the same sum of means
    assert max(values) - min(values) < 12.0 / 4


async def test_failed_average_falls_back_to_own_share():
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
        [report] = await strategy.finish()
    assert report.skipped
    assert "b" in report.detail
    # round 1: g = -0.5 -> φ = 0.75; finish: mean unknown -> own/2 - own/2 = 0; b = -0.25
    # φ -= 0 + 0.5 * -0.25 -> 0.875 (momentum keeps moving)
    torch.testing.assert_close(model.weight, torch.tensor([[0.875]]))


class SlowGroups(FixedGroups):
    """Group agreement that, like the round coordinator, waits until the last member arrives."""

    def __init__(self, members, arrived):
        super().__init__(members)
        self.arrived = arrived

    async def group_for(self, key):
        if key != "round/1":  # the first round has nothing to overlap: it may wait
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
