"""Where the outer state lives does not change a bit of it: the chunked pseudo-gradient, both
placements, and the outer step of today (plain fp32 math with ``torch.optim.SGD``) agree."""

from __future__ import annotations

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.outer_placement import (
    OuterPlacement,
    clone_like,
    copy_into,
    device_bytes,
    pseudo_gradient,
    streamed_pseudo_gradient,
)
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import create_strategy
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica.train.strategies.eager import EagerDiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

TINY = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
PEERS = ("a", "b")


class FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (3,), (0,), (64, 17), (1,)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize("chunk_bytes", [4, 12, 100, 4096, 1 << 20])
def test_the_chunked_pseudo_gradient_is_bit_identical_to_outer_minus_inner(chunk_bytes):
    outer, inner = _tensors(1), _tensors(2)
    reference = [o - i for o, i in zip(outer, inner, strict=True)]
    streamed = streamed_pseudo_gradient(outer, inner, chunk_bytes=chunk_bytes)
    for got, want in zip(streamed, reference, strict=True):
        assert got.dtype == torch.float32
        assert got.shape == want.shape
        assert torch.equal(got, want)


def test_a_low_precision_model_is_subtracted_in_fp32():
    outer, inner = _tensors(3), _tensors(4, torch.bfloat16)
    reference = [o - i.to(torch.float32) for o, i in zip(outer, inner, strict=True)]
    for got, want in zip(streamed_pseudo_gradient(outer, inner, chunk_bytes=10), reference, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(pseudo_gradient(outer, inner), reference, strict=True):
        assert torch.equal(got, want)


def test_both_placements_copy_the_model_in_fp32_on_the_cpu():
    params = _tensors(5, torch.bfloat16)
    for where in ("cpu", "same"):
        copies = OuterPlacement(where=where).copy(params)
        assert all(c.dtype == torch.float32 and c.device.type == "cpu" for c in copies)
        assert all(torch.equal(c, p.float()) for c, p in zip(copies, params, strict=True))
    copies = clone_like(params)
    assert all(torch.equal(c, p) for c, p in zip(copies, params, strict=True))
    assert all(c.data_ptr() != p.data_ptr() for c, p in zip(copies, params, strict=True) if p.numel())
    targets = [torch.zeros_like(p) for p in params]
    copy_into(targets, params)
    assert all(torch.equal(t, p) for t, p in zip(targets, params, strict=True))
    assert device_bytes(params, torch.device("cpu")) == sum(p.numel() * 2 for p in params)


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="outer_state_device"):
        OuterPlacement(where="gpu")
    with pytest.raises(ValueError, match="outer_state_device"):
        DiLoCoConfig(outer_state_device="gpu")
    with pytest.raises(ConfigError, match="outer_state_device"):
        TrainSettings(outer_state_device="gpu")


def test_a_strategy_without_a_placement_refuses_same_in_one_line():
    with pytest.raises(ConfigError, match="outer_state_device is not used by strategy 'streaming'"):
        strategy_config(TrainSettings(strategy="streaming", outer_state_device="same"))
    assert strategy_config(TrainSettings(strategy="diloco", outer_state_device="same")).outer_state_device == "same"


async def _train_rounds(strategy: str, config, rounds: int = 3, steps: int = 2) -> list[dict]:
    """Two replicas of the tiny GPT, each inner step a deterministic nudge of its own, ``rounds``
    outer rounds; every replica's outer state after the last."""
    network = InMemoryCollectiveGroup(list(PEERS))
    models = [build_model(TINY, seed=0) for _ in PEERS]
    strategies = [
        create_strategy(strategy, m, collective=network.member(p), groups=FixedGroups(PEERS), config=config)
        for m, p in zip(models, PEERS, strict=True)
    ]

    async def replica(i: int) -> None:
        gen = torch.Generator().manual_seed(10 + i)
        async with trio.open_nursery() as nursery:
            strategies[i].bind_nursery(nursery)
            for step in range(1, rounds * steps + 1):
                with torch.no_grad():
                    for p in models[i].parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-2)
                await strategies[i].after_inner_step(step)
            await strategies[i].finish()

    async with trio.open_nursery() as nursery:
        for i in range(len(PEERS)):
            nursery.start_soon(replica, i)
    return [s.outer_state_dict() for s in strategies]


def _hash(state: dict) -> str:
    return weights_hash({**state["params"], **{f"m/{k}": v for k, v in state.get("momentum", {}).items()}})


@pytest.mark.parametrize(
    ("strategy", "config_of"),
    [
        ("diloco", lambda where: DiLoCoConfig(inner_steps=2, outer_state_device=where)),
        ("diloco", lambda where: DiLoCoConfig(inner_steps=2, averaging="gossip", outer_state_device=where)),
        ("diloco", lambda where: DiLoCoConfig(
            inner_steps=2, averaging="gossip", overlap=True, outer_state_device=where)),
        ("eager", lambda where: EagerDiLoCoConfig(inner_steps=2, outer_state_device=where)),
    ],
    ids=["allreduce", "gossip", "gossip-overlap", "eager"],
)
async def test_both_placements_hold_the_same_outer_weights_after_the_same_rounds(strategy, config_of):
    on_cpu = await _train_rounds(strategy, config_of("cpu"))
    on_device = await _train_rounds(strategy, config_of("same"))
    assert [_hash(s) for s in on_cpu] == [_hash(s) for s in on_device]
    assert on_cpu[0]["params"].keys()
    assert all(t.device.type == "cpu" for t in on_device[0]["params"].values())


async def test_the_outer_step_is_todays_fp32_sgd_on_the_mean_pseudo_gradient():
    """The reference is the outer step as written before placements existed: Δ_m = φ − θ_m in
    fp32, the mean over the replicas, ``torch.optim.SGD(nesterov=True)`` on φ, θ ← φ."""
    states = await _train_rounds("diloco", DiLoCoConfig(inner_steps=2), rounds=3)
    models = [build_model(TINY, seed=0) for _ in PEERS]
    phi = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    sgd = torch.optim.SGD(phi, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(len(PEERS))]
    for _ in range(3):
        deltas = []
        for model, gen in zip(models, gens, strict=True):
            with torch.no_grad():
                for _ in range(2):
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-2)
            deltas.append([f.detach() - p.detach() for f, p in zip(phi, model.parameters(), strict=True)])
        for f, *each in zip(phi, *deltas, strict=True):
            f.grad = (each[0] + each[1]) / 2
        sgd.step()
        for model in models:
            with torch.no_grad():
                for p, f in zip(model.parameters(), phi, strict=True):
                    p.copy_(f)
    names = [n for n, _ in models[0].named_parameters()]
    assert weights_hash(states[0]["params"]) == weights_hash(dict(zip(names, [f.detach() for f in phi], strict=True)))
