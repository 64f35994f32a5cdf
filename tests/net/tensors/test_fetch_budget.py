"""The node-wide budget for fetch answers, against many identities on real libp2p hosts."""

from __future__ import annotations

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.errors import PeerUnavailableError
from lattica.net.host import build_host
from lattica.net.serving_budget import ServingBudget, ServingLimits
from lattica.net.tensors import TensorLimits, TensorService, TensorServiceConfig

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
MIB = 1 << 20
STATE = torch.arange(MIB // 4, dtype=torch.float32)  # a 1 MiB "outer state"


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def _service(nursery, limits: TensorLimits) -> tuple[object, TensorService]:
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    await nursery.start(_run_host, host)
    service = TensorService(host, key_pair, config=TensorServiceConfig(limits=limits, fast_path=False))
    await nursery.start(service.run)
    return host, service


async def _swarm(nursery, owner_limits: TensorLimits, members: int):
    owner_host, owner = await _service(nursery, owner_limits)
    owner.serve("outer/params", STATE)
    fetchers = []
    for _ in range(members):
        host, service = await _service(nursery, TensorLimits())
        await host.connect(info_from_p2p_addr(owner_host.get_addrs()[0]))
        fetchers.append(service)
    return owner, fetchers


async def test_many_identities_asking_for_the_state_get_no_more_than_the_node_budget():
    # per identity, each may have the state every 0.2 s: 8 identities could pull ~120 MiB in 3 s
    limits = TensorLimits(
        fetch_repeat_s=0.2, fetch_serve_bytes_per_s=1 * MIB, fetch_serve_burst_bytes=2 * MIB, max_fetch_answers=8,
    )
    outcome = {"served": 0, "busy": 0}
    refusals: set[str] = set()

    async def pull_repeatedly(fetcher: TensorService, owner: TensorService, until: float) -> None:
        while trio.current_time() < until:
            try:
                got = await fetcher.fetch(owner.peer_id, ["outer/params"])
            except PeerUnavailableError as exc:
                refusals.add(str(exc).split(" (peer ")[0])
                outcome["busy"] += 1
                await trio.sleep(0.05)
            else:
                assert torch.equal(got["outer/params"], STATE)
                outcome["served"] += 1

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            owner, fetchers = await _swarm(nursery, limits, members=8)
            started = trio.current_time()
            async with trio.open_nursery() as flood:
                for fetcher in fetchers:
                    flood.start_soon(pull_repeatedly, fetcher, owner, started + 3.0)
            elapsed = trio.current_time() - started
            budget_bytes = 2 * MIB + 1 * MIB * elapsed + STATE.numel() * 4  # burst, refill, one answer in debt
            sent = sum(owner.stats.sent_to(f.peer_id) for f in fetchers)
            assert outcome["served"] * MIB <= budget_bytes
            assert sent <= budget_bytes + outcome["served"] * 64 * 1024  # framing of each answer
            assert outcome["busy"] > 0
            assert refusals == {"peer does not serve ['outer/params'] or is busy"}
            # busy is not bad input: the owner dropped nobody and nobody dropped the owner
            assert not owner.stats.protocol_errors
            assert all(not f.stats.protocol_errors for f in fetchers)
            await trio.sleep(1.5)  # the bucket refills: a fetch is served again
            assert torch.equal((await fetchers[0].fetch(owner.peer_id, ["outer/params"]))["outer/params"], STATE)
            nursery.cancel_scope.cancel()


async def test_a_normal_join_is_not_slowed_by_the_default_budget():
    """Eight joiners fetch a 4 MiB state from one holder at once: every one served at first ask."""
    state = torch.randn(MIB)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            owner, joiners = await _swarm(nursery, TensorLimits(), members=8)
            owner.serve("outer/params", state)
            results: list[torch.Tensor] = []

            async def join(joiner: TensorService) -> None:
                results.append((await joiner.fetch(owner.peer_id, ["outer/params"]))["outer/params"])

            async with trio.open_nursery() as joins:
                for joiner in joiners:
                    joins.start_soon(join, joiner)
            assert len(results) == 8
            assert all(torch.equal(r, state) for r in results)
            assert owner.fetch_gate.budget.busy == 0
            nursery.cancel_scope.cancel()


def test_the_budget_bounds_bytes_and_answers_in_flight():
    budget = ServingBudget(ServingLimits(bytes_per_s=100.0, burst_bytes=1000, max_answers=2))
    assert budget.try_start(0.0)
    assert budget.try_start(0.0)  # two answers started while the bucket was full
    assert budget.try_take(5000, 0.0)  # larger than the bucket: it goes out, the bucket is in debt
    assert not budget.try_take(10, 0.0)  # the other one finds it empty: busy after all
    budget.done()
    budget.done()
    assert not budget.try_start(39.9)  # 4000 bytes of debt take 40 s to pay
    assert budget.try_start(40.1)
    assert budget.try_take(1, 40.1)
    assert budget.try_start(40.2)
    assert not budget.try_start(40.3)  # two answers in flight
    assert budget.busy == 3
    assert budget.served_bytes == 5001
    budget.done()
    budget.done()
    assert budget.try_start(1000.0)
    assert budget.tokens == 1000  # refills up to the burst, no further


@pytest.mark.parametrize(
    "kwargs", [{"bytes_per_s": 0.0}, {"bytes_per_s": float("inf")}, {"burst_bytes": 0}, {"max_answers": 0}]
)
def test_budget_limits_are_validated(kwargs):
    settings = {"bytes_per_s": 1.0, "burst_bytes": 1, "max_answers": 1, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ServingLimits(**settings)
