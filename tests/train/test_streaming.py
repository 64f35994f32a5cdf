import pytest
import torch
import trio

from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.quantize import dequantize_4bit, quantize_4bit
from lattica.train.strategies.streaming import (
    StreamingDiLoCo,
    StreamingDiLoCoConfig,
    fragment_indices,
    mean_of_each,
    mix_into_local,
    quantize_each,
    sync_due,
)
from lattica.train.strategies.traffic import allreduce_bytes
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup


class TwoScalarBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2))
        with torch.no_grad():
            for b in self.blocks:
                b.weight.zero_()


def test_blocks_are_strided_and_the_rest_fills_the_smaller_fragment():
    model = build_model(GPTConfig(n_layer=4, d_model=16, n_head=2, context=8), seed=0)
    frags = fragment_indices(model, 2)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(frags[0] + frags[1]) == list(range(len(names)))
    assert all(
        names[i].startswith(("blocks.0.", "blocks.2."))
        for i in frags[0]
        if names[i].startswith("blocks.")
    )
    assert all(
        names[i].startswith(("blocks.1.", "blocks.3."))
        for i in frags[1]
        if names[i].startswith("blocks.")
    )
    sizes = [sum(list(model.parameters())[i].numel() for i in f) for f in frags]
    # whole tensors cannot balance exactly; the gap is at most the largest non-block tensor
    assert abs(sizes[0] - sizes[1]) <= 256 * 16


def test_fragment_p_syncs_every_h_steps_offset_by_p_h_over_p():
    due = {
        p: [s for s in range(1, 13) if sync_due(s, p, inner_steps=4, fragments=2)] for p in (0, 1)
    }
    assert due == {0: [4, 8, 12], 1: [6, 10]}


def test_mixing_is_a_convex_combination():
    theta = [torch.tensor([2.0])]
    mix_into_local(theta, [torch.tensor([4.0])], 0.25)
    torch.testing.assert_close(theta[0], torch.tensor([3.5]))  # 0.25·2 + 0.75·4


async def run(models, strategies, steps, drift):
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


async def run_in_worker_thread(models, strategies, steps, drift):
    """As ``run``, with every step's sync done by ``sync_in_thread`` in a worker thread."""

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


@pytest.mark.parametrize("runner", [run, run_in_worker_thread])
async def test_two_workers_match_hand_computed_fragment_trajectories(runner):
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    cfg = StreamingDiLoCoConfig(
        inner_steps=2,
        fragments=2,
        overlap_steps=1,
        mixing=0.5,
        outer_lr=1.0,
        outer_momentum=0.5,
        codec="fp4",
        block_size=2,
    )
    models = [TwoScalarBlocks(), TwoScalarBlocks()]
    strategies = [
        StreamingDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    await runner(models, strategies, steps=4, drift=[1.0, 3.0])
    # fragment 0 syncs at 2 (mean Δ -4) and applies at 3: θ̃ = 6, θ = (4.5, 7.5);
    #   syncs again at 4 (Δ = 6 - (5.5, 10.5), mean -2), applied by finish: θ̃ = 10,
    #   θ = (7.75, 10.25)
    # fragment 1 syncs at 3 (mean Δ -6) and applies at 4: θ̃ = 9, θ = (6.5, 10.5)
    expected_local = [[7.75, 6.5], [10.25, 10.5]]
    for m, exp in zip(models, expected_local, strict=True):
        got = [p.item() for p in m.parameters()]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(exp))
    for s in strategies:
        torch.testing.assert_close(
            torch.stack(list(s.evaluation_parameters())).flatten(), torch.tensor([10.0, 9.0])
        )
        # a scalar travels as one code byte plus one fp32 scale, to the one other worker
        assert s.traffic.syncs == 3
        assert s.traffic.peak_sync_bytes == 5
    assert strategies[0].completed_rounds == 1  # 3 fragment syncs = 1.5 full rounds


async def test_three_gpt_replicas_share_outer_weights_at_a_fraction_of_the_peak():
    peers = ["a", "b", "c"]
    group = InMemoryCollectiveGroup(peers)
    cfg = StreamingDiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=1)
    gpt = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
    models = [build_model(gpt, seed=0) for _ in peers]
    strategies = [
        StreamingDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
        for m, p in zip(models, peers, strict=True)
    ]
    await run(models, strategies, steps=12, drift=[0.01, -0.02, 0.03])
    outers = [list(s.evaluation_parameters()) for s in strategies]
    for other in outers[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outers[0], other, strict=True))
    assert all(s.traffic.syncs == 5 for s in strategies)  # fragment 0 at 4, 8, 12; 1 at 6, 10
    assert all(s.completed_rounds == 2 for s in strategies)
    diloco_peak = allreduce_bytes(list(models[0].parameters()), 3, "fp32")
    assert strategies[0].traffic.peak_sync_bytes <= diloco_peak / cfg.fragments
    # the local weights were pulled toward the shared outer weights, not identical to them
    assert not torch.equal(next(models[0].parameters()), outers[0][0])


async def test_syncs_in_the_worker_thread_are_bit_identical_to_the_trio_thread():
    peers = ["a", "b", "c"]
    cfg = StreamingDiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=1)
    gpt = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
    drift = [0.01, -0.02, 0.03]
    outcomes = []
    for runner in (run, run_in_worker_thread):
        group = InMemoryCollectiveGroup(peers)
        models = [build_model(gpt, seed=0) for _ in peers]
        strategies = [
            StreamingDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
            for m, p in zip(models, peers, strict=True)
        ]
        await runner(models, strategies, steps=13, drift=drift)
        outcomes.append(
            [
                [*m.parameters(), *s.evaluation_parameters()]
                for m, s in zip(models, strategies, strict=True)
            ]
        )
        assert all(s.completed_rounds == 2 and s.traffic.syncs == 5 for s in strategies)
    on_trio, in_thread = outcomes
    for a, b in zip(on_trio, in_thread, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


async def test_a_worker_waiting_for_a_late_mean_is_released_by_cancellation():
    group = InMemoryCollectiveGroup(["a", "b"])
    cfg = StreamingDiLoCoConfig(inner_steps=2, fragments=2, overlap_steps=1, block_size=2)
    strategy = StreamingDiLoCo(
        TwoScalarBlocks(), collective=group.member("a"), groups=FixedGroups(["a", "b"]), config=cfg
    )

    async def cancel_soon(nursery):
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            strategy.bind_nursery(nursery)
            assert await trio.to_thread.run_sync(strategy.sync_in_thread, 1) == []
            assert await trio.to_thread.run_sync(strategy.sync_in_thread, 2) == []  # sent
            nursery.start_soon(cancel_soon, nursery)
            # "b" never sends: the worker waits for the mean due at step 3 until the cancel
            reports = await trio.to_thread.run_sync(strategy.sync_in_thread, 3)
    assert [r.skipped for r in reports] == [True]
    assert all(x.item() == 0.0 for x in strategy.evaluation_parameters())


async def test_a_fragment_applied_at_its_own_sync_step_works_in_the_worker_thread():
    peers = ["a", "b"]
    cfg = StreamingDiLoCoConfig(inner_steps=2, fragments=2, overlap_steps=0)  # τ = 0
    outcomes = []
    for runner in (run, run_in_worker_thread):
        group = InMemoryCollectiveGroup(peers)
        models = [TwoScalarBlocks(), TwoScalarBlocks()]
        strategies = [
            StreamingDiLoCo(m, collective=group.member(p), groups=FixedGroups(peers), config=cfg)
            for m, p in zip(models, peers, strict=True)
        ]
        await runner(models, strategies, steps=5, drift=[1.0, 3.0])
        outcomes.append([p.item() for m in models for p in m.parameters()])
    assert outcomes[0] == outcomes[1]


async def test_dead_peer_skips_the_fragment_without_stalling():
    peers = ["a", "b"]
    group = InMemoryCollectiveGroup(peers)
    cfg = StreamingDiLoCoConfig(inner_steps=2, fragments=2, overlap_steps=0, block_size=2)
    model = TwoScalarBlocks()
    strategy = StreamingDiLoCo(
        model, collective=group.member("a"), groups=FixedGroups(peers), config=cfg
    )
    group.fail("b")
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            strategy.bind_nursery(nursery)
            reports = [r for s in range(1, 5) for r in await strategy.after_inner_step(s)]
    assert len(reports) == 3
    assert all(r.skipped for r in reports)
    assert all(x.item() == 0.0 for x in strategy.evaluation_parameters())


def test_next_sync_start_is_the_next_step_where_a_sync_is_due():
    from lattica.train.strategies.streaming import next_sync_start

    for inner_steps, fragments in ((4, 2), (6, 3), (5, 1)):
        for p in range(fragments):
            due = [
                s
                for s in range(1, 60)
                if sync_due(s, p, inner_steps=inner_steps, fragments=fragments)
            ]
            for step in range(0, 40):
                expected = min(s for s in due if s > step)
                got = next_sync_start(step, p, inner_steps=inner_steps, fragments=fragments)
                assert got == expected, (inner_steps, fragments, p, step)


def _fragment_like(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 65), (0,), (64,), (2, 2, 33), (1,)]
    return [torch.randn(shapes[i % len(shapes)], generator=g) * 10 ** (i % 3) for i in range(count)]


def test_a_fragment_is_quantized_bit_for_bit_as_tensor_by_tensor():
    tensors = _fragment_like(13, seed=1)
    batched = quantize_each(tensors, block_size=64)
    for t, q in zip(tensors, batched, strict=True):
        alone = quantize_4bit(t, block_size=64)
        assert q.shape == t.shape
        assert torch.equal(q.codes, alone.codes)
        assert torch.equal(q.scales, alone.scales)


def test_the_mean_of_a_fragment_is_bit_for_bit_the_tensor_by_tensor_mean():
    like = _fragment_like(13, seed=2)
    members = [quantize_each(_fragment_like(13, seed=s), block_size=64) for s in (3, 4, 5)]
    means = mean_of_each(members, like=like)
    for i, reference in enumerate(like):
        total = torch.zeros(reference.shape, dtype=torch.float32)
        for encodings in members:
            total += dequantize_4bit(encodings[i])
        expected = total / len(members)
        assert means[i].shape == reference.shape
        assert torch.equal(means[i], expected)


_VIEWS = {"as_strided", "reshape", "view", "slice", "narrow", "detach", "split", "alias",
          "_reshape_alias", "unsqueeze", "flatten", "expand", "select"}


def _torch_kernels(fn) -> int:
    """Torch calls that compute or copy (views excluded) while ``fn`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name.removeprefix("aten::") for e in prof.events() if e.name.startswith("aten::")]
    return len([n for n in names if n not in _VIEWS])


def test_quantizing_and_averaging_a_fragment_costs_about_one_torch_call_per_tensor():
    # every torch call on the event-loop thread is a chance to take the GIL from the training
    # thread; tensor by tensor this was ~200 calls per tensor of a fragment (3 members)
    small, large = _fragment_like(3, seed=6), _fragment_like(30, seed=7)

    def work(tensors: list[torch.Tensor]) -> None:
        encodings = quantize_each(tensors, block_size=64)
        mean_of_each([encodings, encodings, encodings], like=tensors)

    few, many = _torch_kernels(lambda: work(small)), _torch_kernels(lambda: work(large))
    assert many - few <= 3 * (len(large) - len(small)), (few, many)
