"""GossipGroups on real in-process libp2p hosts on loopback: no coordinator, no global wait."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.coordination.gossip import GROUP_PROTOCOL, GossipGroups
from lattica.coordination.groups import GossipGroupsConfig, draw_step_groups
from lattica.errors import BrokenError
from lattica.net.host import build_host

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
GRACE_S = 1.5


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def _peers(
    nursery: trio.Nursery, count: int, *, views: Callable[[str, list[str]], Sequence[str]] | None = None
) -> dict[str, GossipGroups]:
    """``count`` connected peers; ``views(me, everyone)``: the members ``me`` holds."""
    ids: list[str] = []
    peers: dict[str, GossipGroups] = {}
    for _ in range(count):
        host = build_host(create_new_key_pair())
        await nursery.start(_run_host, host)
        me = host.get_id().to_base58()
        ids.append(me)
        members = (lambda me=me: views(me, ids)) if views is not None else (lambda: list(ids))
        peers[me] = GossipGroups(
            host, peer_id=me, run_id="run", members=members, config=GossipGroupsConfig(grace_s=GRACE_S)
        )
        await nursery.start(peers[me].run)
    hosts = [p.host for p in peers.values()]
    for i, host in enumerate(hosts):
        for other in hosts[i + 1 :]:
            await host.connect(info_from_p2p_addr(other.get_addrs()[0]))
    return peers


async def _ask_all(peers: dict[str, GossipGroups], key: str, only: Sequence[str] | None = None):
    groups: dict[str, tuple[str, ...]] = {}
    took: dict[str, float] = {}

    async def ask(me: str) -> None:
        started = trio.current_time()
        groups[me] = tuple(await peers[me].group_for(key))
        took[me] = trio.current_time() - started

    async with trio.open_nursery() as nursery:
        for me in only if only is not None else peers:
            nursery.start_soon(ask, me)
    return groups, took


async def test_every_peer_gets_its_stripe_when_views_agree() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await _peers(nursery, 5)
            for key in ("round/0", "round/1", "round/2"):
                stripes = draw_step_groups(peers, key=key, group_size=2)
                groups, _ = await _ask_all(peers, key)
                for me, group in groups.items():
                    assert group == next(s for s in stripes if me in s)
            nursery.cancel_scope.cancel()


async def test_a_silent_partner_costs_only_its_own_group_the_grace() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await _peers(nursery, 6)
            key = "round/0"
            stripes = draw_step_groups(peers, key=key, group_size=2)
            frozen = stripes[0][0]

            async def never_answer(stream) -> None:
                await trio.sleep_forever()

            peers[frozen].host.set_stream_handler(GROUP_PROTOCOL, never_answer)  # holds streams, answers nothing
            others = [p for p in peers if p != frozen]
            groups, took = await _ask_all(peers, key, only=others)
            partner = next(p for p in stripes[0] if p != frozen)
            assert groups[partner] == (partner,)  # averages alone
            assert GRACE_S - 0.1 <= took[partner] <= GRACE_S + 2.0
            for stripe in stripes[1:]:
                for me in stripe:
                    assert groups[me] == stripe
                    assert took[me] < GRACE_S  # nobody outside the frozen peer's group waited for it
            nursery.cancel_scope.cancel()


async def test_a_late_peer_finds_its_group_gone_and_goes_alone() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await _peers(nursery, 2)
            early, late = sorted(peers)
            # the late peer has not reached the step: it still answers, so the early one is confirmed
            groups, _ = await _ask_all(peers, "round/0", only=[early])
            assert groups[early] == tuple(sorted(peers))
            await trio.sleep(GRACE_S + 0.2)  # the early peer averaged (or gave up) and moved on
            groups, took = await _ask_all(peers, "round/0", only=[late])
            assert groups[late] == (late,)
            assert took[late] < GRACE_S  # told at once, not timed out
            # and a step the early peer moved past is gone as well
            await peers[early].group_for("round/1")
            groups, _ = await _ask_all(peers, "round/0", only=[late])
            assert groups[late] == (late,)
            nursery.cancel_scope.cancel()


async def test_differing_views_average_only_with_those_who_agree() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            def views(me: str, everyone: list[str]) -> list[str]:
                # the first peer has not seen the last one join yet
                return [p for p in everyone if not (me == everyone[0] and p == everyone[-1])]

            peers = await _peers(nursery, 5, views=views)
            ids = list(peers)
            for t in range(6):
                key = f"round/{t}"
                groups, _ = await _ask_all(peers, key)
                for p in ids:
                    for q in ids:
                        assert (q in groups[p]) == (p in groups[q])  # pairs agree both ways
                    assert p in groups[p]
                # the blind peer is never grouped with the peer it does not see
                assert ids[-1] not in groups[ids[0]]
                # peers whose stripes do not involve the blind peer are untouched
                full = draw_step_groups(ids, key=key, group_size=2)
                for stripe in full:
                    if ids[0] not in stripe and ids[-1] not in stripe:
                        for p in stripe:
                            assert groups[p] == stripe
            nursery.cancel_scope.cancel()


async def test_a_malformed_request_is_refused_and_the_peer_keeps_answering() -> None:
    from libp2p.peer.id import ID

    from lattica.net.wire import read_message, write_message

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await _peers(nursery, 2)
            a, b = list(peers)
            stream = await peers[a].host.new_stream(ID.from_base58(b), [GROUP_PROTOCOL])
            await write_message(stream, {"run": "run", "key": "round/0", "group": ["not-me"]})
            with trio.fail_after(5), pytest.raises(BrokenError):  # closed on us, unanswered
                await read_message(stream)
            groups, _ = await _ask_all(peers, "round/0")
            assert groups[a] == tuple(sorted(peers))
            nursery.cancel_scope.cancel()
