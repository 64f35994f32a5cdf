"""TensorService behaviour on real in-process hosts: stalled consumers, limits, config checks."""

from __future__ import annotations

import multiaddr
import pytest
import torch
import trio
import trio.testing
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


@pytest.fixture
def fast_clock() -> trio.testing.MockClock:
    """trio's clock at 4x the wall clock: yamux's 5 s timeout and the 6 s stall are both on it."""
    return trio.testing.MockClock(rate=4.0)


@pytest.mark.parametrize("fast", [False, True])
async def test_a_consumer_stalled_past_the_yamux_timeout_loses_nothing(fast, fast_clock):
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


@pytest.mark.parametrize("into", ["input", "buffer", "pieces"])
async def test_allreduce_writes_the_exact_mean_into_out(into):
    gen = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(10_001, generator=gen), torch.randn(3, 2, generator=gen)] for _ in range(2)]
    if into != "pieces":  # one flat fp32 tensor: the mean is assembled in ``out`` itself
        inputs = [[x[0]] for x in inputs]
    exact = [(a + b) / 2 for a, b in zip(*inputs, strict=True)]
    keep = [[t.clone() for t in x] for x in inputs]
    outs = [x if into != "buffer" else [torch.full_like(t, float("nan")) for t in x] for x in inputs]
    results = {}
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            services = await _pair(nursery, TensorServiceConfig())
            group = [s.peer_id for s in services]

            async def one(i):
                results[i] = await services[i].allreduce(inputs[i], group=group, tag="into", out=outs[i])

            async with trio.open_nursery() as inner:
                for i in range(2):
                    inner.start_soon(one, i)
            nursery.cancel_scope.cancel()
    for i in range(2):
        assert [r.data_ptr() for r in results[i]] == [o.data_ptr() for o in outs[i]]
        for got, want in zip(outs[i], exact, strict=True):
            assert torch.equal(got, want)
        if into == "buffer":  # the inputs are untouched
            assert all(torch.equal(a, b) for a, b in zip(inputs[i], keep[i], strict=True))


class _ScriptedChannel:
    """A fast channel whose frames the test hands over one by one."""

    def __init__(self, frames_in: trio.MemoryReceiveChannel) -> None:
        self._frames = frames_in

    async def receive_frame(self, into):
        piece = await self._frames.receive()
        target = into()
        if target is not None and len(piece) <= len(target):
            target[: len(piece)] = piece
            return target[: len(piece)], True
        return memoryview(piece), False


async def test_a_withdrawn_posted_buffer_gets_no_more_bytes():
    # A collective that ends (aborted, deadline) withdraws its buffers; a message already being
    # written into one must not touch it afterwards — it may be the caller's own tensor.
    from lattica.net.tensors import frames
    from lattica.numerics import codecs

    service = TensorService(build_host(create_new_key_pair()), create_new_key_pair(),
                            config=TensorServiceConfig())
    payload = torch.arange(2048, dtype=torch.float32)
    spec, raw = codecs.encode(payload, "fp32")
    header = frames.encode_put("t/ag", 1, [spec])
    target = torch.full((2048,), -1.0)
    service.post_receive("peer", "t/ag", 1, codecs.byte_view(target))
    send, receive = trio.open_memory_channel(0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service._read_messages, _ScriptedChannel(receive), "peer", "fast")
            await send.send(header)
            await send.send(bytes(raw[:4096]))  # the first half lands in the posted buffer
            await trio.testing.wait_all_tasks_blocked()
            assert torch.equal(target[:1024], payload[:1024])
            service.post_receive("peer", "t/ag", 1, None)
            await send.send(bytes(raw[4096:]))
            await trio.testing.wait_all_tasks_blocked()
            await send.send(b"")  # the channel ends cleanly between messages
    assert torch.equal(target[1024:], torch.full((1024,), -1.0))
    assert len(service.mailbox) == 0
    assert service.budget.total == 0
    assert not service.budget.transfers.get("peer")
