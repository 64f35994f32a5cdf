"""SparseLoCo: the pure math against hand-computed values, then three in-memory replicas."""

from __future__ import annotations

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.numerics import sparse
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import create_strategy, strategy_class
from lattica.train.strategies.sparseloco import (
    SparseLoCo,
    SparseLoCoConfig,
    compress_with_feedback,
    flatten,
    mean_of_sparse,
)
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

TINY = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)
PEERS = ("a", "b", "c")


def test_compress_with_feedback_hand_computed():
    # c = 0.5 * e + delta = [1, -3, 0.5, 0.25 | 2, 0, 0, -1]; top-1 per chunk of 4 (fp32 values)
    e = torch.tensor([2.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    delta = torch.tensor([0.0, -3.0, 0.0, 0.0, 2.0, 0.0, 0.0, -1.0])
    sent, new_e = compress_with_feedback(e, delta, decay=0.5, chunk=4, k=1, value_codec="fp32")
    assert sent.indices.tolist() == [[1], [0]]
    assert sent.values.tolist() == [[-3.0], [2.0]]
    assert new_e.tolist() == [1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 0.0, -1.0]
    assert e.tolist() == [2.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # pure: the input is untouched


def test_error_feedback_invariant_with_2bit_values():
    """e' + decoded(sent) == β·e + Δ: nothing is lost, only delayed."""
    gen = torch.Generator().manual_seed(5)
    e, delta = torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen)
    sent, new_e = compress_with_feedback(e, delta, decay=0.95, chunk=4096, k=64, value_codec="2bit")
    candidate = e * 0.95 + delta
    dense = sparse.densify(sent, candidate.numel())
    assert torch.allclose(new_e + dense, candidate, atol=1e-6, rtol=0)
    unsent = dense == 0
    assert torch.equal(new_e[unsent], candidate[unsent])  # the rest is kept exactly
    assert int((dense != 0).sum()) == 3 * 64  # k per chunk of 4096 (the last one padded)


def test_mean_of_sparse_hand_computed():
    a = sparse.SparseChunks(chunk=4, k=1, indices=torch.tensor([[1]]), values=torch.tensor([[3.0]]))
    b = sparse.SparseChunks(chunk=4, k=1, indices=torch.tensor([[1]]), values=torch.tensor([[1.0]]))
    c = sparse.SparseChunks(chunk=4, k=1, indices=torch.tensor([[2]]), values=torch.tensor([[-3.0]]))
    assert torch.equal(mean_of_sparse([a, b, c], 4), torch.tensor([0.0, 4.0, -3.0, 0.0]) / 3)


def test_config_defaults_and_validation():
    config = SparseLoCoConfig()
    assert config.chunk == 4096
    assert 0.01 <= config.density <= 0.03
    assert config.k == 65
    assert config.outer_lr == 2.75
    with pytest.raises(ValueError, match="density"):
        SparseLoCoConfig(density=0.0)
    with pytest.raises(ValueError, match="value_codec"):
        SparseLoCoConfig(value_codec="int3")
    assert strategy_class("sparseloco") is SparseLoCo


def test_run_settings_reach_the_config():
    settings = TrainSettings(strategy="sparseloco", inner_steps=20, outer_lr=0.8)
    config = strategy_config(settings)
    assert (config.inner_steps, config.outer_lr) == (20, 0.8)


def _replicas(network: InMemoryCollectiveGroup, config: SparseLoCoConfig):
    strategies = []
    for i, peer in enumerate(PEERS):
        model = build_model(TINY, seed=0)
        strategy = create_strategy(
            "sparseloco", model, collective=network.member(peer), groups=FixedGroups(PEERS), config=config
        )
        with torch.no_grad():  # each replica's own "inner training"
            gen = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        strategies.append(strategy)
    return strategies


async def _sync_all(strategies) -> list:
    reports = {}

    async def one(i):
        reports[i] = await strategies[i].sync()

    async with trio.open_nursery() as nursery:
        for i in range(len(strategies)):
            nursery.start_soon(one, i)
    return [reports[i] for i in range(len(strategies))]


async def test_three_replicas_apply_the_same_sparse_mean_bit_identically():
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05)
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, config)
    before = [p.clone() for p in strategies[0].outer_parameters()]
    for round_ in range(3):
        if round_ == 0:  # what "a" will send: its encoded ŝ, in the scheme smallest for it
            a = strategies[0]
            delta = flatten([o - p.detach() for o, p in zip(a.outer_parameters(), a.model.parameters(), strict=True)])
            sent, _ = compress_with_feedback(a.error, delta, decay=config.error_decay, chunk=256, k=config.k,
                                             value_codec="2bit")
            payload = sparse.encode(sent, value_codec="2bit", scheme=sparse.smallest_scheme_for(sent)).numel()
        reports = await _sync_all(strategies)
        assert all(not r.skipped for r in reports)
        for s in strategies[1:]:
            for a, b in zip(strategies[0].outer_parameters(), s.outer_parameters(), strict=True):
                assert torch.equal(a, b)
            assert not torch.equal(s.error, strategies[0].error)  # e is private
        for s in strategies:  # the local weights restart from θ
            for p, o in zip(s.model.parameters(), s.outer_parameters(), strict=True):
                assert torch.equal(p.detach(), o)
        if round_ == 0:
            numel = sum(p.numel() for p in before)
            chunks = sparse.chunk_count(numel, 256)
            elias_fano = sparse.encoded_size(
                chunk=256, k=config.k, chunks=chunks, value_codec="2bit", scheme="elias_fano"
            )
            assert payload <= elias_fano
            assert reports[0].bytes_sent == 2 * payload  # to each of the two others
            assert network.bytes_sent["a"] == 2 * payload
    moved = sum(float((a - b).abs().sum()) for a, b in zip(before, strategies[0].outer_parameters(), strict=True))
    assert moved > 0
    assert strategies[0].accounting()["syncs"] == 3


async def test_a_failed_round_changes_neither_theta_nor_e():
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, max_attempts=1)
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, config)
    await _sync_all(strategies)  # one good round: e is non-zero
    a = strategies[0]
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(0.01)
    outer, error = [p.clone() for p in a.outer_parameters()], a.error.clone()
    local = [p.detach().clone() for p in a.model.parameters()]
    network.fail("c")
    report = await a.sync()
    assert report.skipped
    assert report.bytes_sent > 0
    assert torch.equal(a.error, error)
    assert all(torch.equal(x, y) for x, y in zip(outer, a.outer_parameters(), strict=True))
    # the local weights keep their progress: the next round's Δ covers both periods
    assert all(torch.equal(x, y.detach()) for x, y in zip(local, a.model.parameters(), strict=True))
    assert a.completed_rounds == 1


def test_a_loaded_state_starts_with_an_empty_backlog():
    network = InMemoryCollectiveGroup(PEERS)
    s = _replicas(network, SparseLoCoConfig(inner_steps=1))[0]
    s.error += 1.0
    state = s.outer_state_dict()
    assert set(state) == {"round", "step", "completed_rounds", "params"}  # e is not shared
    s.load_outer_state_dict(state)
    assert not bool(s.error.any())


FOUR = ("a", "b", "c", "d")


def _gossip_replicas(network: InMemoryCollectiveGroup, config: SparseLoCoConfig, peers=FOUR, *, leading=None):
    """One replica per peer, each moved by its own random step; replica ``i`` in ``leading``
    moves only the leading tenth of each tensor (clustered indices: another payload length)."""
    strategies = []
    for i, peer in enumerate(peers):
        model = build_model(TINY, seed=0)
        strategy = create_strategy(
            "sparseloco", model, collective=network.member(peer), groups=FixedGroups(peers), config=config
        )
        with torch.no_grad():
            gen = torch.Generator().manual_seed(i)
            for p in model.parameters():
                step = torch.randn(p.shape, generator=gen) * 0.01
                if leading is not None and i in leading:
                    step.view(-1)[max(1, step.numel() // 10):] = 0.0
                p.add_(step)
        strategies.append(strategy)
    return strategies


async def test_gossip_averages_the_sparse_contributions_inside_each_group():
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, averaging="gossip", group_size=2)
    assert SparseLoCo.averages_in_groups(config)
    network = InMemoryCollectiveGroup(FOUR)
    strategies = _gossip_replicas(network, config)
    assert not strategies[0].replicas_agree
    theta0 = torch.cat([p.reshape(-1) for p in strategies[0].outer_parameters()])
    deltas, sents = [], []
    for s in strategies:
        delta = flatten([o - p.detach() for o, p in zip(s.outer_parameters(), s.model.parameters(), strict=True)])
        sent, _ = compress_with_feedback(s.error, delta, decay=config.error_decay, chunk=256, k=config.k,
                                         value_codec="2bit")
        deltas.append(delta)
        sents.append(sent)
    reports = await _sync_all(strategies)
    numel = theta0.numel()
    for i, (s, report) in enumerate(zip(strategies, reports, strict=True)):
        assert len(report.group) == 2  # pairs drawn from the four
        assert FOUR[i] in report.group
        members = [FOUR.index(p) for p in report.group]
        mean = mean_of_sparse([sents[j] for j in members], numel)
        theta = torch.cat([p.reshape(-1) for p in s.outer_parameters()])
        assert torch.equal(theta, theta0 - config.outer_lr * mean)  # this group's mean, nothing else
        # e holds what was not sent; what was sent was applied (to this group)
        assert torch.allclose(s.error, deltas[i] - sparse.densify(sents[i], numel), atol=1e-7)
        assert report.bytes_sent == sparse.encode(
            sents[i], value_codec="2bit", scheme=sparse.smallest_scheme_for(sents[i])
        ).numel()  # one partner
    groups = {r.group for r in reports}
    assert len(groups) == 2  # two disjoint pairs: their replicas now differ
    a, b = (next(s for s, r in zip(strategies, reports, strict=True) if r.group == g) for g in groups)
    assert not torch.equal(a.outer_parameters()[0], b.outer_parameters()[0])


async def test_gossip_alone_when_the_partner_is_gone_applies_its_own_contribution():
    config = SparseLoCoConfig(
        inner_steps=1, chunk=256, density=0.05, averaging="gossip", group_size=2, exchange_timeout_s=1.0
    )
    network = InMemoryCollectiveGroup(FOUR)
    strategies = _gossip_replicas(network, config)
    for peer in FOUR[1:]:
        network.fail(peer)
    a = strategies[0]
    theta0 = torch.cat([p.reshape(-1) for p in a.outer_parameters()])
    delta = flatten([o - p.detach() for o, p in zip(a.outer_parameters(), a.model.parameters(), strict=True)])
    sent, _ = compress_with_feedback(a.error, delta, decay=config.error_decay, chunk=256, k=config.k,
                                     value_codec="2bit")
    report = await a.sync()
    assert report.group == ("a",)
    assert not report.skipped
    assert "no answer from" in report.detail
    theta = torch.cat([p.reshape(-1) for p in a.outer_parameters()])
    assert torch.equal(theta, theta0 - config.outer_lr * sparse.densify(sent, theta0.numel()))


def test_gossip_run_settings_reach_the_config():
    settings = TrainSettings(strategy="sparseloco", averaging="gossip", group_size=3, group_grace_s=2.0)
    config = strategy_config(settings)
    assert (config.averaging, config.group_size, config.exchange_timeout_s) == ("gossip", 3, 2.0)
    with pytest.raises(ValueError, match="averaging"):
        SparseLoCoConfig(averaging="ring")


async def test_a_truncated_payload_fails_the_round_and_names_the_sender():
    """Replica c sends its real rice payload cut short: a and b refuse it (the decode error names
    c), skip the round and keep θ and e as they were — nothing half-applied."""
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, max_attempts=1)
    network = InMemoryCollectiveGroup(PEERS)
    strategies = _replicas(network, config)
    a, b, c = strategies
    before = [(list(p.clone() for p in s.outer_parameters()), s.error.clone()) for s in (a, b)]
    delta = flatten([o - p.detach() for o, p in zip(c.outer_parameters(), c.model.parameters(), strict=True)])
    sent, _ = compress_with_feedback(c.error, delta, decay=config.error_decay, chunk=256, k=config.k,
                                     value_codec="2bit")
    payload = sparse.encode(sent, value_codec="2bit", scheme="rice")
    assert sparse.smallest_scheme_for(sent) == "rice"
    member = network.member("c")
    reports = {}

    async def honest(i: int) -> None:
        reports[i] = await strategies[i].sync()

    async def truncating(peer: str) -> None:
        await member.exchange([payload[:-1].clone()], peer=peer, tag="sparseloco/round/0/0", codec="raw")

    async with trio.open_nursery() as nursery:
        for i in (0, 1):
            nursery.start_soon(honest, i)
        for peer in ("a", "b"):
            nursery.start_soon(truncating, peer)
    for i, s in enumerate((a, b)):
        assert reports[i].skipped
        assert "invalid sparse payload: rice indices" in reports[i].detail
        assert "(peer c)" in reports[i].detail
        outer, error = before[i]
        assert all(torch.equal(x, y) for x, y in zip(outer, s.outer_parameters(), strict=True))
        assert torch.equal(s.error, error)
        assert s.completed_rounds == 0


async def test_gossip_pairs_whose_payloads_differ_in_length_still_average():
    """A sparse payload's length depends on its indices (Rice or Elias-Fano coded gaps): two
    partners' payloads rarely have the same byte count, and each must still take the other's."""
    pair = ("a", "b")
    config = SparseLoCoConfig(inner_steps=1, chunk=256, density=0.05, averaging="gossip", group_size=2)
    network = InMemoryCollectiveGroup(pair)
    strategies = _gossip_replicas(network, config, pair, leading={1})
    lengths = []
    for strategy in strategies:
        delta = flatten(
            [o - q.detach() for o, q in zip(strategy.outer_parameters(), strategy.model.parameters(), strict=True)],
        )
        sent, _ = compress_with_feedback(strategy.error, delta, decay=config.error_decay, chunk=256, k=config.k,
                                         value_codec="2bit")
        lengths.append(sparse.encode(sent, value_codec="2bit", scheme=sparse.smallest_scheme_for(sent)).numel())
    assert lengths[0] != lengths[1]  # the case under test
    reports = await _sync_all(strategies)
    for report in reports:
        assert report.group == pair, report.detail
    assert torch.equal(strategies[0].outer_parameters()[0], strategies[1].outer_parameters()[0])
