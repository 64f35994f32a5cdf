"""TensorService behaviour on real in-process hosts: stalled consumers, limits, config checks."""

from __future__ import annotations

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.net.host import build_host
from lattica.net.tensors import TensorLimits, TensorService, TensorServiceConfig
from lattica.net.tensors.limits import MemoryBudget

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def _pair(nursery, config: TensorServiceConfig):
    services = []
    for _ in range(2):
        key_pair = create_new_key_pair()
        host = build_host(key_pair)
        await nursery.start(_run_host, host)
        service = TensorService(host, key_pair, config=config)
        await nursery.start(service.run)
        services.append((host, service))
    await services[1][0].connect(info_from_p2p_addr(services[0][0].get_addrs()[0]))
    return services[0][1], services[1][1]


@pytest.mark.parametrize("fast", [False, True])
async def test_a_consumer_stalled_past_the_yamux_timeout_loses_nothing(fast):
    # yamux fails a write the receiver has not read for 5 s; readers drain into buffers at once.
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery, TensorServiceConfig(fast_path=fast))
            blobs = [torch.randn(1 << 20) for _ in range(3)]
            for i, blob in enumerate(blobs):
                await b.send(a.peer_id, "stall", [blob], part=i)
            await trio.sleep(6)  # the consumer is busy elsewhere
            for i, blob in enumerate(blobs):
                ((_, got),) = await a.receive(b.peer_id, "stall", part=i)
                assert torch.equal(got, blob)
            path = "fast" if fast else "libp2p"
            assert a.stats.bytes_received[(b.peer_id, path)] >= 3 * 4 << 20
            nursery.cancel_scope.cancel()


async def test_messages_over_the_memory_cap_are_refused_and_others_still_flow():
    limits = TensorLimits(max_message_bytes=1 << 20, max_total_bytes=2 << 20, max_peer_bytes=2 << 20)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery, TensorServiceConfig(limits=limits))
            await b.send(a.peer_id, "big", [torch.zeros(1 << 19)])  # 2 MiB > message cap
            small = torch.arange(1000.0)
            await b.send(a.peer_id, "small", [small])
            ((_, got),) = await a.receive(b.peer_id, "small")
            assert torch.equal(got, small)
            assert a.stats.refused[b.peer_id] == 1
            assert a.budget.total == 0
            with trio.move_on_after(0.5):
                await a.receive(b.peer_id, "big")
                pytest.fail("a refused message was delivered")
            nursery.cancel_scope.cancel()


async def test_exchange_and_deadline_through_cancel_scope():
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery, TensorServiceConfig())
            with trio.move_on_after(0.5) as scope:  # b never answers: the caller's deadline wins
                await a.exchange([torch.ones(3)], peer=b.peer_id, tag="lonely")
            assert scope.cancelled_caught
            nursery.cancel_scope.cancel()


def test_budget_accounting_and_config_validation():
    budget = MemoryBudget(TensorLimits(max_message_bytes=100, max_total_bytes=150, max_peer_bytes=120,
                                       max_peer_transfers=2))
    assert budget.try_reserve("p", 100) is None
    assert budget.try_reserve("p", 101) is not None  # message cap
    assert budget.try_reserve("p", 30) is not None  # peer share
    assert budget.try_reserve("q", 60) is not None  # total
    assert budget.try_reserve("q", 50) is None
    budget.end_transfer("p")
    budget.release("p", 100)
    assert budget.total == 50
    with pytest.raises(ValueError, match="fast_port"):
        TensorServiceConfig(fast_port=70000)
    with pytest.raises(ValueError, match="max_peer_bytes"):
        TensorLimits(max_total_bytes=1, max_peer_bytes=2)
