"""DeMo: DCT blocks and fast components against hand-computed values, then in-memory replicas."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.errors import RemoteProtocolError
from lattica.numerics import demo_codec, sparse
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import create_strategy, strategy_class
from lattica.train.strategies.demo_momentum import (
    BlockLayout,
    DeMo,
    DeMoConfig,
    block_shape,
    dct_matrix,
    dense_tensors,
    extract_fast_components,
    from_blocks,
    largest_divisor,
    mean_components,
    to_blocks,
)
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

TINY = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)
PEERS = ("a", "b", "c")


def test_dct_matrix_hand_computed_and_orthonormal():
    r = 1 / math.sqrt(2)
    assert torch.allclose(dct_matrix(2), torch.tensor([[r, r], [r, -r]]))
    d = dct_matrix(64)
    assert torch.allclose(d @ d.T, torch.eye(64), atol=1e-5)


def test_a_constant_block_has_only_a_dc_coefficient():
    # 1-D run of 4 ones: DC = sum / sqrt(4) = 2, every other coefficient 0
    coeffs = to_blocks(torch.ones(4), block_shape(torch.Size([4]), 4))
    assert torch.allclose(coeffs, torch.tensor([[2.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    coeffs = to_blocks(torch.full((2, 2), 3.0), block_shape(torch.Size([2, 2]), 2))
    assert torch.allclose(coeffs, torch.tensor([[6.0, 0.0, 0.0, 0.0]]), atol=1e-6)  # 3 * 4 / 2


@pytest.mark.parametrize("shape", [(64, 192), (5,), (12, 10), (3, 4, 8), ()])
def test_dct_round_trip(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    tiles = block_shape(torch.Size(shape), 4)
    back = from_blocks(to_blocks(x, tiles), tiles, torch.Size(shape))
    assert back.shape == x.shape
    assert torch.allclose(back, x, atol=1e-5)


def test_tiles_use_the_largest_divisor_up_to_the_chunk():
    assert largest_divisor(192, 64) == 64
    assert largest_divisor(10, 4) == 2
    assert largest_divisor(7, 4) == 1
    t = block_shape(torch.Size([12, 10]), 4)
    assert (t.r, t.c, t.blocks, t.block_numel) == (4, 2, 15, 8)


def test_extracting_fast_components_removes_exactly_what_is_sent():
    gen = torch.Generator().manual_seed(4)
    momenta = [torch.randn(64, 128, generator=gen), torch.randn(64, generator=gen)]
    layout = BlockLayout([m.shape for m in momenta], 64, 32)
    assert layout.sizes == [64, 4096]
    assert layout.chunks == {64: 1, 4096: 2}
    sent = extract_fast_components(momenta, layout, "fp32")
    assert sent[4096].values.shape == (2, 32)
    assert sent[64].values.shape == (1, 32)
    coeffs = layout.split(momenta)[4096]
    kept = torch.gather(coeffs, 1, sent[4096].indices).abs()
    assert bool((kept.min(dim=1).values >= coeffs.abs().topk(32, dim=1).values[:, -1] - 1e-6).all())
    removed = dense_tensors(sent, layout)
    rest = [m - r for m, r in zip(momenta, removed, strict=True)]
    assert torch.allclose(rest[0] + removed[0], momenta[0], atol=1e-6)
    # what stays has none of the sent coefficients left
    left = layout.split(rest)[4096]
    assert float(torch.gather(left, 1, sent[4096].indices).abs().max()) < 1e-4


def test_mean_components_is_the_fp32_mean_of_the_sparse_coefficients():
    layout = BlockLayout([torch.Size([4])], 4, 1)
    a = {4: sparse.SparseChunks(chunk=4, k=1, indices=torch.tensor([[0]]), values=torch.tensor([[2.0]]))}
    b = {4: sparse.SparseChunks(chunk=4, k=1, indices=torch.tensor([[0]]), values=torch.tensor([[4.0]]))}
    # Q = [3, 0, 0, 0]: IDCT is the constant 3 / sqrt(4) = 1.5
    (x,) = mean_components([a, b], layout)
    assert torch.allclose(x, torch.full((4,), 1.5))


def test_config_defaults_and_registration():
    c = DeMoConfig()
    assert (c.chunk, c.topk, c.momentum_decay, c.value_codec) == (64, 189, 0.999, "int8")
    assert strategy_class("demo") is DeMo
    assert type(strategy_config(TrainSettings(strategy="demo"))) is DeMoConfig
    with pytest.raises(ValueError, match="topk"):
        DeMoConfig(topk=0)


class CountingGroups(FixedGroups):
    """The same members every time, and the keys asked for."""

    def __init__(self, members):
        super().__init__(members)
        self.keys: list[str] = []

    async def group_for(self, key):
        self.keys.append(key)
        return await super().group_for(key)


def _replicas(network, config, groups=None):
    strategies = []
    for peer in PEERS:
        model = build_model(TINY, seed=0)
        provider = groups[peer] if groups else FixedGroups(PEERS)
        s = create_strategy("demo", model, collective=network.member(peer), groups=provider, config=config)
        s.attach_inner_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        strategies.append(s)
    return strategies


def _set_grads(strategies, seed):
    for i, s in enumerate(strategies):
        gen = torch.Generator().manual_seed(seed * 10 + i)
        for p in s.model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)


async def _step_all(strategies, step):
    async with trio.open_nursery() as nursery:
        for s in strategies:
            nursery.start_soon(s.before_optimizer_step, step)


async def test_three_replicas_take_the_same_sign_step():
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, DeMoConfig(chunk=8, topk=4))
    before = [p.detach().clone() for p in strategies[0].model.parameters()]
    for step in (1, 2, 3):
        _set_grads(strategies, step)
        await _step_all(strategies, step)
        for s in strategies[1:]:
            for a, b in zip(strategies[0].model.parameters(), s.model.parameters(), strict=True):
                assert torch.equal(a, b)
        assert all(p.grad is None for s in strategies for p in s.model.parameters())
    assert not torch.equal(strategies[0].momenta[0], strategies[1].momenta[0])  # m is private
    # without weight decay each step moves every entry by -lr, 0 or +lr
    moved = [(p.detach() - b).abs().reshape(-1) for p, b in zip(strategies[0].model.parameters(), before, strict=True)]
    steps = torch.cat(moved) / 0.01
    assert float((steps - steps.round()).abs().max()) < 1e-3
    assert float(steps.max()) <= 3 + 1e-3
    assert float(steps.max()) > 2.5
    payload = sum(
        demo_codec.encode(sparse.top_k_per_chunk(torch.zeros(n * strategies[0].layout.chunks[n]), chunk=n,
                                                 k=strategies[0].layout.k[n]), codec="int8").numel()
        for n in strategies[0].layout.sizes
    )
    assert strategies[0].accounting()["last_sync_bytes"] == 2 * payload
    assert strategies[0].applied_steps == 3
    assert network.bytes_sent["a"] == 3 * 2 * payload


async def test_a_failed_step_leaves_weights_and_puts_the_components_back():
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(
        network, DeMoConfig(chunk=8, topk=4, max_attempts=1, momentum_decay=0.5, grad_clip=0.0)
    )
    a = strategies[0]
    _set_grads(strategies, 1)
    await _step_all(strategies, 1)
    momentum = [m.clone() for m in a.momenta]
    weights = [p.detach().clone() for p in a.model.parameters()]
    _set_grads(strategies, 2)
    grads = [p.grad.clone() for p in a.model.parameters()]
    network.fail("c")
    await a.before_optimizer_step(2)
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, a.model.parameters(), strict=True))
    for m, m0, g in zip(a.momenta, momentum, grads, strict=True):
        assert torch.allclose(m, 0.5 * m0 + 0.01 * g, atol=1e-6)  # m <- β·m + η·g, nothing removed
    assert a.applied_steps == 1


async def test_a_round_is_reported_every_inner_steps_with_its_bytes():
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, DeMoConfig(inner_steps=2, chunk=8, topk=4))
    for step in (1, 2):
        _set_grads(strategies, step)
        await _step_all(strategies, step)
        reports = await strategies[0].after_inner_step(step)
        assert len(reports) == (step == 2)
    (report,) = reports
    assert report.group == PEERS
    assert not report.skipped
    assert report.bytes_sent == network.bytes_sent["a"]
    assert strategies[0].completed_rounds == 1
    state = strategies[0].outer_state_dict()
    assert (state["round"], state["step"]) == (1, 2)
    strategies[1].load_outer_state_dict(state)
    assert strategies[1].completed_rounds == 1
    assert not any(bool(m.any()) for m in strategies[1].momenta)  # a loaded state starts with m = 0


async def test_the_group_is_agreed_once_per_window_not_every_step():
    network = InMemoryCollectiveGroup(PEERS)
    groups = {peer: CountingGroups(PEERS) for peer in PEERS}
    strategies = _replicas(network, DeMoConfig(inner_steps=3, chunk=8, topk=4), groups)
    for step in range(1, 8):
        _set_grads(strategies, step)
        await _step_all(strategies, step)
    assert all(s.applied_steps == 7 for s in strategies)
    assert groups["a"].keys == ["round/0", "round/1", "round/2"]  # steps 1, 4 and 7
    strategies[0].load_outer_state_dict(strategies[1].outer_state_dict())
    _set_grads(strategies, 8)
    await _step_all(strategies, 8)
    assert groups["a"].keys[-1] == "round/2"  # a loaded state agrees on its group afresh
    assert len(groups["a"].keys) == 4
    assert len(groups["b"].keys) == 3


async def test_a_failed_exchange_retries_in_a_fresh_group_that_serves_the_window():
    class DropsCOnRetry(CountingGroups):
        async def group_for(self, key):
            self.keys.append(key)
            return list(PEERS) if key.startswith("round/") else list(PEERS[:2])

    network = InMemoryCollectiveGroup(PEERS)
    groups = {peer: DropsCOnRetry(PEERS) for peer in PEERS}
    strategies = _replicas(network, DeMoConfig(inner_steps=4, chunk=8, topk=4), groups)
    a, b = strategies[:2]
    network.fail("c")  # gone after the window's group was agreed with it
    for step in (1, 2):
        _set_grads(strategies, step)
        async with trio.open_nursery() as nursery:
            for s in (a, b):
                nursery.start_soon(s.before_optimizer_step, step)
    assert a.applied_steps == b.applied_steps == 2
    assert groups["a"].keys == ["round/0", "step/1/retry/1"]  # step 2 kept the retry's group
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


async def test_the_gradient_is_clipped_on_each_replica_before_it_enters_m():
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, DeMoConfig(chunk=8, topk=4, max_attempts=1, grad_clip=0.5))
    a = strategies[0]
    _set_grads(strategies, 1)
    grads = [p.grad.clone() for p in a.model.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    assert norm > 1
    network.fail("b")  # the step fails: m keeps everything folded in, nothing removed
    await a.before_optimizer_step(1)
    for m, g in zip(a.momenta, grads, strict=True):
        assert torch.allclose(m, 0.01 * g * 0.5 / norm, atol=1e-7)


async def test_int8_values_keep_replicas_identical_and_the_rounding_error_in_m():
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, DeMoConfig(chunk=8, topk=4, value_codec="int8", grad_clip=0.0))
    a = strategies[0]
    _set_grads(strategies, 1)
    grads = [p.grad.clone() for p in a.model.parameters()]
    await _step_all(strategies, 1)
    for s in strategies[1:]:
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), s.model.parameters(), strict=True))
    # m = η·g − IDCT(sent), with sent the int8 values every receiver decodes: what m lost is
    # exactly what went out, rounding error included
    m0 = [0.01 * g for g in grads]
    sent = extract_fast_components(m0, a.layout, "int8")
    exact = extract_fast_components(m0, a.layout, "fp32")
    assert any(not torch.equal(sent[n].values, exact[n].values) for n in a.layout.sizes)
    for m, want in zip(a.momenta, [x - r for x, r in zip(m0, dense_tensors(sent, a.layout), strict=True)], strict=True):
        assert torch.allclose(m, want, atol=1e-7)
    payload = sum(
        demo_codec.encoded_size(chunk=n, k=a.layout.k[n], chunks=a.layout.chunks[n], codec="int8")
        for n in a.layout.sizes
    )
    assert network.bytes_sent["a"] == 2 * payload
    assert a.accounting()["last_sync_bytes"] == 2 * payload


async def test_a_hostile_payload_fails_the_exchange_and_the_retry_drops_its_sender():
    class DropsCOnRetry(FixedGroups):
        def __init__(self, members):
            super().__init__(members)
            self.keys: list[str] = []

        async def group_for(self, key):
            self.keys.append(key)
            return list(PEERS) if key.startswith("round/") else list(PEERS[:2])

    network = InMemoryCollectiveGroup(PEERS)
    groups = {peer: DropsCOnRetry(PEERS) for peer in PEERS}
    config = DeMoConfig(chunk=8, topk=4, value_codec="int8")
    a, b, _ = _replicas(network, config, groups)
    layout = a.layout
    hostile = [
        demo_codec.encode(
            sparse.top_k_per_chunk(torch.ones(n * layout.chunks[n]), chunk=n, k=layout.k[n]), codec="int8",
        )
        for n in layout.sizes
    ]
    hostile[0][16:20] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)  # a NaN scale
    rejected: list[RemoteProtocolError] = []
    decode = a._decode

    def recording_decode(tensors, peer):
        try:
            return decode(tensors, peer)
        except RemoteProtocolError as exc:
            rejected.append(exc)
            raise

    a._decode = recording_decode  # type: ignore[method-assign]
    c = network.member("c")
    _set_grads([a, b], 1)
    async with trio.open_nursery() as nursery:
        for s in (a, b):
            nursery.start_soon(s.before_optimizer_step, 1)
        for peer in ("a", "b"):
            nursery.start_soon(lambda peer=peer: c.exchange(hostile, peer=peer, tag="demo/step/1/0", codec="raw"))
    assert [(e.peer_id, "scale" in str(e)) for e in rejected] == [("c", True)]
    assert groups["a"].keys == ["round/0", "step/1/retry/1"]  # the retry's group has no c
    assert a.applied_steps == b.applied_steps == 1
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in a.model.parameters())


def test_the_default_payload_is_over_20x_below_ddp_on_the_benchmark_model():
    # DDP's butterfly all-reduce sends 2 (M-1)/M of the fp32 model per step; DeMo sends its
    # payload to each of the M - 1 others (M = 4, the benchmark's tiny model)
    model = build_model("tiny", seed=0)
    shapes = [p.shape for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    config = DeMoConfig()
    layout = BlockLayout(shapes, config.chunk, config.topk)
    assert layout.chunks == {64: 28, 4096: 30}
    assert layout.k == {64: 64, 4096: 189}
    payload = sum(
        demo_codec.encoded_size(chunk=n, k=layout.k[n], chunks=layout.chunks[n], codec=config.value_codec)
        for n in layout.sizes
    )
    assert payload == 12_454
    ddp = 2 * 3 * numel * 4 // 4
    assert ddp / (3 * payload) >= 20  # 20.02
