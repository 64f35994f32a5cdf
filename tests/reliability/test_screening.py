"""Hostile contributions to an all-reduce: excluded at the reducer, replicas stay identical.

Unit tests of ``reduce_parts``; the real data plane (three in-process ``TensorService`` hosts
on loopback) with a member that sends NaN; and DiLoCo training in memory where one member's
pseudo-gradient is NaN and another's is huge, while the honest ones keep learning.
"""

from __future__ import annotations

from functools import partial

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.net.host import build_host
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.numerics.screen import PLAIN_MEAN, ContributionScreen, reduce_parts
from lattica.train.engine.model import GPTConfig, build_model, lm_loss
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

PEERS = ["a", "b", "c", "d"]


def _parts(*rows):
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def test_the_default_screen_is_the_plain_mean_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(1000, generator=gen) for _ in PEERS]
    mean, rejected = reduce_parts(parts, PEERS)
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    assert torch.equal(mean, total / 4)
    assert rejected == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_contributions_are_excluded(bad) -> None:
    mean, rejected = reduce_parts(_parts([1, 2], [3, bad], [5, 6]), ["a", "b", "c"])
    assert torch.equal(mean, torch.tensor([3.0, 4.0]))
    assert [r.peer for r in rejected] == ["b"]


def test_opposite_infinities_and_an_overflowing_sum_are_screened_exactly() -> None:
    # +inf and -inf in the same element cancel to NaN in the sum: both members are still named
    mean, rejected = reduce_parts(_parts([1, float("inf")], [3, float("-inf")], [5, 6]), ["a", "b", "c"])
    assert torch.equal(mean, torch.tensor([5.0, 6.0]))
    assert [r.peer for r in rejected] == ["a", "b"]
    # finite contributions whose sum overflows are all accepted (the mean is what fp32 gives)
    big = 3e38
    mean, rejected = reduce_parts(_parts([big, 1], [big, 2]), ["a", "b"])
    assert rejected == []
    assert torch.equal(mean, (torch.tensor([big, 1.0]) + torch.tensor([big, 2.0])) / 2)


def test_the_mean_lands_in_the_given_buffer() -> None:
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1000, generator=gen) for _ in PEERS]
    out = torch.full((1000,), float("nan"))
    mean, _ = reduce_parts(parts, PEERS, out=out)
    assert mean.data_ptr() == out.data_ptr()
    assert torch.equal(out, reduce_parts(parts, PEERS)[0])
    for screen in (ContributionScreen(max_norm_ratio=4), ContributionScreen(trim=1)):
        out = torch.full((1000,), float("nan"))
        mean, _ = reduce_parts(parts, PEERS, screen, out=out)
        assert mean.data_ptr() == out.data_ptr()
        assert torch.equal(out, reduce_parts(parts, PEERS, screen)[0])


def test_outliers_by_norm_are_excluded_by_default_and_can_be_turned_off() -> None:
    parts = _parts([1, 1], [1.2, 0.8], [0.9, 1.1], [1e6, 1e6])
    mean, rejected = reduce_parts(parts, PEERS)  # DEFAULT_SCREEN: 10x the median norm
    assert [r.peer for r in rejected] == ["d"]
    torch.testing.assert_close(mean, torch.tensor([1.0333333, 0.9666667]))
    mean, rejected = reduce_parts(parts, PEERS, PLAIN_MEAN)
    assert rejected == []
    assert mean[0] > 1e5
    mean, rejected = reduce_parts(parts, PEERS, ContributionScreen(max_norm_ratio=4))
    assert [r.peer for r in rejected] == ["d"]


def test_a_finite_1e30_update_is_refused_by_default() -> None:
    parts = _parts([1, -1], [1.1, -0.9], [0.8, -1.2])
    parts.append(parts[0] * 1e30)
    mean, rejected = reduce_parts(parts, PEERS)
    assert [r.peer for r in rejected] == ["d"]
    torch.testing.assert_close(mean, torch.tensor([0.9666667, -1.0333333]))


def test_two_contributions_have_no_majority_to_screen_by_norm() -> None:
    mean, rejected = reduce_parts(_parts([1, 1], [100, 100]), ["a", "b"])
    assert rejected == []
    assert torch.equal(mean, torch.tensor([50.5, 50.5]))


def test_a_zero_median_norm_gives_no_scale_to_screen_by() -> None:
    mean, rejected = reduce_parts(_parts([0, 0], [0, 0], [3, 3]), ["a", "b", "c"])
    assert rejected == []
    assert torch.equal(mean, torch.tensor([1.0, 1.0]))


def test_coordinate_wise_median() -> None:
    parts = _parts([1, 9], [2, 1], [3, 2], [1e3, -1e3])
    median, rejected = reduce_parts(parts, PEERS, ContributionScreen(median=True))
    assert rejected == []
    assert torch.equal(median, torch.tensor([2.0, 1.0]))  # the lower middle value of four
    two, _ = reduce_parts(parts[:2], PEERS[:2], ContributionScreen(median=True))
    assert torch.equal(two, torch.tensor([1.5, 5.0]))


def test_a_trimmed_mean_that_cannot_trim_says_so(caplog) -> None:
    parts = _parts([1, 1], [3, 3])
    with caplog.at_level("WARNING", logger="lattica.numerics.screen"):
        mean, _ = reduce_parts(parts, ["a", "b"], ContributionScreen(trim=2))
    assert torch.equal(mean, torch.tensor([2.0, 2.0]))
    assert "needs at least 5 contributions, got 2" in caplog.text


def test_clipping_and_trimmed_mean_bound_one_member_s_influence() -> None:
    parts = _parts([1, 1], [1, 1], [1, 1], [100, 100])
    clipped, _ = reduce_parts(parts, PEERS, ContributionScreen(clip_ratio=2))
    assert clipped.max() <= (3 + 2) / 4 + 1e-6
    trimmed, _ = reduce_parts(parts, PEERS, ContributionScreen(trim=1))
    assert torch.equal(trimmed, torch.tensor([1.0, 1.0]))


def test_nothing_accepted_means_no_update() -> None:
    mean, rejected = reduce_parts(_parts([float("nan")], [float("inf")]), ["a", "b"])
    assert torch.equal(mean, torch.zeros(1))
    assert len(rejected) == 2


def test_screen_config_is_validated() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ContributionScreen(max_norm_ratio=0.5)
    with pytest.raises(ValueError, match="negative"):
        ContributionScreen(trim=-1)
    with pytest.raises(ValueError, match="finite"):
        ContributionScreen(max_norm_ratio=float("inf"))
    with pytest.raises(ValueError, match="not both"):
        ContributionScreen(trim=1, median=True)


# -- the real data plane ---------------------------------------------------------------------


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()


async def _three_connected_services(nursery: trio.Nursery, config: TensorServiceConfig) -> dict[str, TensorService]:
    """Three tensor services on real loopback hosts, all connected to each other, by peer id."""
    services = []
    for _ in range(3):
        key_pair = create_new_key_pair()
        host = build_host(key_pair)
        await nursery.start(_run_host, host)
        service = TensorService(host, key_pair, config=config)
        await nursery.start(service.run)
        services.append((host, service))
    for i, (host, _) in enumerate(services):
        for other, _ in services[i + 1 :]:
            await host.connect(info_from_p2p_addr(other.get_addrs()[0]))
    return {s.peer_id: s for _, s in services}


async def test_a_member_sending_nan_is_excluded_and_every_replica_gets_the_same_bits() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            by_id = await _three_connected_services(nursery, TensorServiceConfig())
            group = sorted(by_id)
            evil = group[1]
            inputs = {p: torch.full((3000,), float(i + 1)) for i, p in enumerate(group)}
            inputs[evil] = torch.full((3000,), float("nan"))
            results: dict[str, torch.Tensor] = {}

            async def reduce(peer: str) -> None:
                out = await by_id[peer].allreduce([inputs[peer]], group=group, tag="poisoned")
                results[peer] = out[0]

            async with trio.open_nursery() as members:
                for peer in group:
                    members.start_soon(partial(reduce, peer))
            honest = [p for p in group if p != evil]
            expected = (inputs[honest[0]] + inputs[honest[1]]) / 2
            for peer in group:
                assert torch.equal(results[peer], expected)
            for peer in group:  # every owner of a part saw the NaN and scored the sender down
                if peer != evil:
                    assert by_id[peer].stats.rejected_contributions[evil] == 1
            nursery.cancel_scope.cancel()


# -- training continues -------------------------------------------------------------------------


class _Groups:
    async def group_for(self, key):
        return tuple(PEERS)


async def test_diloco_keeps_learning_with_a_nan_and_a_huge_member() -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, d_model=32, n_head=2, context=16)
    network = InMemoryCollectiveGroup(PEERS, screen=ContributionScreen(max_norm_ratio=4))
    models = [build_model(config, seed=0) for _ in PEERS]
    strategies = [
        DiLoCo(m, collective=network.member(p), groups=_Groups(), config=DiLoCoConfig(inner_steps=4))
        for m, p in zip(models, PEERS, strict=True)
    ]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    pattern = torch.arange(17) % 5  # a learnable sequence
    x, y = pattern[:-1].unsqueeze(0).repeat(8, 1), pattern[1:].unsqueeze(0).repeat(8, 1)
    first = lm_loss(models[0](x), y).item()
    for step in range(1, 41):
        for i, (m, opt) in enumerate(zip(models, optimizers, strict=True)):
            opt.zero_grad()
            lm_loss(m(x), y).backward()
            opt.step()
            if step % 4 == 0 and PEERS[i] in ("c", "d"):
                with torch.no_grad():
                    for p in m.parameters():
                        p.fill_(float("nan")) if PEERS[i] == "c" else p.mul_(1e4)
        async with trio.open_nursery() as nursery:
            for s in strategies:
                nursery.start_soon(s.after_inner_step, step)
    honest = models[:2]
    for a, b in zip(honest[0].parameters(), honest[1].parameters(), strict=True):
        assert torch.equal(a, b)
    last = lm_loss(honest[0](x), y).item()
    assert torch.isfinite(torch.tensor(last))
    assert last < 0.5 * first, (first, last)
    assert {r.peer for r in network.rejections} == {"c", "d"}


# -- the daemon's default screen, with real peers -------------------------------------------------


class _FixedGroup:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


async def _diloco_round_with_a_scaled_member(screen: ContributionScreen) -> tuple[dict, str, dict]:
    """Three DiLoCo members on real loopback data planes; one multiplies its weights by 1e30
    before the round. Returns the models by peer, the scaler's id, and the data planes."""
    models: dict[str, torch.nn.Module] = {}
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            by_id = await _three_connected_services(nursery, TensorServiceConfig(screen=screen))
            group = sorted(by_id)
            evil = group[2]
            strategies = {}
            for peer in group:
                torch.manual_seed(0)
                models[peer] = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
                strategies[peer] = DiLoCo(
                    models[peer], collective=by_id[peer], groups=_FixedGroup(group),
                    config=DiLoCoConfig(inner_steps=2),
                )
            for step in (1, 2):
                for i, peer in enumerate(group):  # an honest inner step each
                    gen = torch.Generator().manual_seed(100 * i + step)
                    x = torch.randn(32, 16, generator=gen)
                    loss = torch.nn.functional.mse_loss(models[peer](x), x.sum(1, keepdim=True))
                    loss.backward()
                    with torch.no_grad():
                        for p in models[peer].parameters():
                            p -= 0.05 * p.grad
                            p.grad = None
                if step == 2:
                    with torch.no_grad():  # finite, and 1e30 times too large
                        for p in models[evil].parameters():
                            p.mul_(1e30)
                async with trio.open_nursery() as members:
                    for peer in group:
                        members.start_soon(strategies[peer].after_inner_step, step)
            nursery.cancel_scope.cancel()
    return models, evil, by_id


async def test_a_1e30_update_from_a_real_peer_does_not_reach_the_weights_by_default() -> None:
    from lattica.config import TrainSettings
    from lattica.train.settings.strategy_settings import contribution_screen

    models, evil, services = await _diloco_round_with_a_scaled_member(contribution_screen(TrainSettings()))
    honest = [p for p in models if p != evil]
    for a, b in zip(models[honest[0]].parameters(), models[honest[1]].parameters(), strict=True):
        assert torch.equal(a, b)
    weights = torch.cat([p.detach().flatten() for p in models[honest[0]].parameters()])
    assert torch.isfinite(weights).all()
    assert weights.abs().max() < 10  # the initial weights are within 1; one outer step moves them little
    for peer in honest:
        assert services[peer].stats.rejected_contributions[evil] >= 1


async def test_without_the_norm_screen_the_1e30_update_reaches_the_weights() -> None:
    """The control: the same round with the plain mean (what the daemon did before)."""
    models, evil, _ = await _diloco_round_with_a_scaled_member(PLAIN_MEAN)
    honest = next(p for p in models if p != evil)
    weights = torch.cat([p.detach().flatten() for p in models[honest].parameters()])
    assert not (torch.isfinite(weights).all() and weights.abs().max() < 10)
