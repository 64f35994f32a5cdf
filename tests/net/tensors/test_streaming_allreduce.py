"""The all-reduce owner sums contributions while their frames arrive, and still screens them.

Three in-process ``TensorService`` hosts on loopback, over the encrypted fast path with small
frames (64 KiB) so each contribution arrives in many frames and spans several sum blocks. The
owner must have summed blocks before its contributions were whole, every member must end
with the same bits (the plain group-order mean of the accepted contributions), and a member
that sends a NaN or a scaled-up update must still be excluded and scored down.
"""

from __future__ import annotations

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.net.host import build_host
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.numerics import screen
from lattica.numerics.streaming_mean import StreamingMean

NUMEL = 3 * (3 * screen.BLOCK + 123)  # three parts of three blocks and a bit
FRAME = 64 << 10


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()


async def _three_services(nursery: trio.Nursery) -> dict[str, TensorService]:
    services = []
    for _ in range(3):
        key_pair = create_new_key_pair()
        host = build_host(key_pair)
        await nursery.start(_run_host, host)
        service = TensorService(host, key_pair, config=TensorServiceConfig(fast_frame_bytes=FRAME))
        await nursery.start(service.run)
        services.append((host, service))
    for i, (host, _) in enumerate(services):
        for other, _ in services[i + 1 :]:
            await host.connect(info_from_p2p_addr(other.get_addrs()[0]))
    return {s.peer_id: s for _, s in services}


@pytest.fixture
def sums_during_arrival(monkeypatch) -> list[int]:
    """Counts the frames after which an owner summed more blocks while its part was not whole."""
    early: list[int] = []
    arrived = StreamingMean.arrived

    def watched(self: StreamingMean, j: int, nbytes: int) -> None:
        before = self.summed
        arrived(self, j, nbytes)
        if self.summed > before and nbytes < self._out.size * 4:
            early.append(j)

    monkeypatch.setattr(StreamingMean, "arrived", watched)
    return early


async def _allreduce_in_place(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    results: dict[str, torch.Tensor] = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            by_id = await _three_services(nursery)
            group = sorted(by_id)
            mine = {peer: inputs[name].clone() for peer, name in zip(group, sorted(inputs), strict=True)}

            async def reduce(peer: str) -> None:
                (results[peer],) = await by_id[peer].allreduce([mine[peer]], group=group, tag="s", out=[mine[peer]])

            async with trio.open_nursery() as members:
                for peer in group:
                    members.start_soon(reduce, peer)
            rejected = {peer: dict(by_id[peer].stats.rejected_contributions) for peer in group}
            names = dict(zip(group, sorted(inputs), strict=True))
            nursery.cancel_scope.cancel()
    return {names[p]: r for p, r in results.items()}, {names[p]: {names[q]: n for q, n in r.items()}
                                                        for p, r in rejected.items()}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(NUMEL, generator=gen) for name in ("a", "b", "c")}


async def test_the_mean_is_summed_while_frames_arrive_and_is_the_same_bits_everywhere(sums_during_arrival) -> None:
    inputs = _inputs()
    results, rejected = await _allreduce_in_place(inputs)
    expected = (inputs["a"] + inputs["b"] + inputs["c"]) / 3
    for name in inputs:
        assert torch.equal(results[name], expected)
        assert rejected[name] == {}
    assert len(sums_during_arrival) > 3  # blocks were summed before the parts were whole


@pytest.mark.parametrize("poison", ["nan", "scaled"])
async def test_a_nan_or_scaled_member_is_excluded_by_the_streaming_owner(poison: str, sums_during_arrival) -> None:
    inputs = _inputs()
    if poison == "nan":  # one NaN in the middle of every member's part
        for lo in range(0, NUMEL, NUMEL // 3):
            inputs["b"][lo + screen.BLOCK + 7] = float("nan")
    else:
        inputs["b"] *= 1e4
    results, rejected = await _allreduce_in_place(inputs)
    expected = (inputs["a"] + inputs["c"]) / 2
    for name in ("a", "c"):
        assert torch.equal(results[name], expected)
        assert rejected[name] == {"b": 1}  # each honest owner excluded b from its part
    assert torch.equal(results["b"], expected)  # b gets the same bits as everyone
    assert sums_during_arrival
