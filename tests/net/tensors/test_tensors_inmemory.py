"""The in-memory Collective used by strategy tests: exact means, exchange, failures, bytes."""

import pytest
import torch
import trio

from lattica.errors import LocalProtocolError, PeerUnavailableError
from lattica_lab.collective import InMemoryCollectiveGroup


async def _run_all(group, fn):
    results = {}

    async def one(peer):
        results[peer] = await fn(group.member(peer), peer)

    async with trio.open_nursery() as nursery:
        for peer in group.peer_ids:
            nursery.start_soon(one, peer)
    return results


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_allreduce_is_exact_fp32_mean(n):
    peers = [f"p{i}" for i in range(n)]
    group = InMemoryCollectiveGroup(peers)
    gen = torch.Generator().manual_seed(n)
    inputs = {p: [torch.randn(7, 3, generator=gen), torch.randn((), generator=gen)] for p in peers}
    out = await _run_all(group, lambda c, p: c.allreduce(inputs[p], group=peers, tag="r"))
    expected = []
    for i in range(2):
        total = torch.zeros_like(inputs[peers[0]][i])
        for p in peers:
            total += inputs[p][i]
        expected.append(total / n)
    for p in peers:
        for got, want in zip(out[p], expected, strict=True):
            assert torch.equal(got, want)
    payload = (21 + 1) * 4
    assert group.bytes_sent[peers[0]] == 2 * (n - 1) * payload // n


async def test_exchange_swaps_tensors():
    group = InMemoryCollectiveGroup(["a", "b"])
    out = await _run_all(
        group, lambda c, p: c.exchange([torch.tensor([ord(p)])], peer="b" if p == "a" else "a", tag="x")
    )
    assert out["a"][0].item() == ord("b")
    assert out["b"][0].item() == ord("a")


async def test_lossy_codec_applies_on_every_member_identically():
    peers = ["a", "b", "c"]
    group = InMemoryCollectiveGroup(peers)
    inputs = {p: [torch.randn(300)] for p in peers}
    out = await _run_all(group, lambda c, p: c.allreduce(inputs[p], group=peers, tag="q", codec="int4"))
    exact = sum(inputs[p][0] for p in peers) / 3
    assert torch.equal(out["a"][0], out["b"][0])
    assert torch.equal(out["a"][0], out["c"][0])
    assert not torch.equal(out["a"][0], exact)
    assert (out["a"][0] - exact).abs().max() < 0.5


async def test_failed_peer_raises_for_pending_and_later_operations():
    group = InMemoryCollectiveGroup(["a", "b", "c"])
    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:

            async def waiting():
                with pytest.raises(PeerUnavailableError) as info:
                    await group.member("a").allreduce([torch.ones(2)], group=["a", "b", "c"], tag="t")
                assert info.value.peer_id == "c"

            nursery.start_soon(waiting)
            await trio.sleep(0.01)
            group.fail("c")
    with pytest.raises(PeerUnavailableError):
        await group.member("b").exchange([torch.ones(1)], peer="c", tag="y")


async def test_misuse_is_a_local_error():
    group = InMemoryCollectiveGroup(["a", "b"])
    with pytest.raises(LocalProtocolError):
        await group.member("a").allreduce([torch.ones(1)], group=["b"], tag="t")
    with pytest.raises(LocalProtocolError):
        await group.member("a").allreduce([torch.ones(1)], group=["a", "b"], tag="t", codec="zip")
