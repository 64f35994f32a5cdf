"""GossipGroups on real in-process libp2p hosts on loopback: no coordinator, no global wait."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from lattica.coordination.gossip import GROUP_PROTOCOL, GossipGroups
from lattica.coordination.groups import GossipGroupsConfig, draw_step_groups
from lattica.errors import BrokenError
from lattica_lab.gossip_peers import gossip_peers

GRACE_S = 1.5
SLOW_GRACE_S = 4.0  # where a hold (half of it) is told apart from an answer at once on a loaded machine


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
            peers = await gossip_peers(nursery, 5, grace_s=GRACE_S)
            for key in ("round/0", "round/1", "round/2"):
                stripes = draw_step_groups(peers, key=key, group_size=2)
                groups, _ = await _ask_all(peers, key)
                for me, group in groups.items():
                    assert group == next(s for s in stripes if me in s)
            nursery.cancel_scope.cancel()


async def test_a_silent_partner_costs_only_its_own_group_the_grace() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 6, grace_s=GRACE_S)
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
            peers = await gossip_peers(nursery, 2, grace_s=SLOW_GRACE_S)
            early, late = sorted(peers)
            hold = GossipGroupsConfig(grace_s=SLOW_GRACE_S).hold_s
            # the late peer has not reached the step: it holds the request, then answers late
            groups, took = await _ask_all(peers, "round/0", only=[early])
            assert groups[early] == (early,)
            assert hold - 0.1 <= took[early] < SLOW_GRACE_S  # held, then told: not the grace
            # reaching it, the late peer leaves out the partner it told late, without waiting
            groups, took = await _ask_all(peers, "round/0", only=[late])
            assert groups[late] == (late,)
            assert took[late] < hold
            # and a step the early peer moved past is gone: told at once
            await peers[early].group_for("round/2")
            groups, took = await _ask_all(peers, "round/1", only=[late])
            assert groups[late] == (late,)
            assert took[late] < hold
            assert peers[late].next_step() == 3  # the gone answer carried the early peer's step 2
            nursery.cancel_scope.cancel()


async def test_a_partner_arriving_within_the_hold_is_confirmed() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 2, grace_s=GRACE_S)
            first, second = sorted(peers)
            groups: dict[str, tuple[str, ...]] = {}

            async def ask(me: str, after: float) -> None:
                await trio.sleep(after)
                groups[me] = tuple(await peers[me].group_for("round/0"))

            async with trio.open_nursery() as inner:
                inner.start_soon(ask, first, 0.0)
                inner.start_soon(ask, second, 0.3)  # within the hold (0.75 s)
            assert groups[first] == groups[second] == (first, second)
            nursery.cancel_scope.cancel()


async def test_a_straggler_is_left_out_at_once_by_whoever_draws_it() -> None:
    """One peer's pace is ~8 s; the others then go on at a fraction of a second per step. The
    peer drawn with it each step is told ``late`` at once (at its pace its next sync falls past
    the asker's hold, two of the asker's short periods) and averages alone; before the readiness
    rule it was confirmed and then waited out the grace in its exchange."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 4, grace_s=SLOW_GRACE_S)
            hold = GossipGroupsConfig(grace_s=SLOW_GRACE_S).hold_s
            straggler = sorted(peers)[0]
            others = [p for p in peers if p != straggler]
            # the straggler's pace: two syncs ~10 s apart (its partners have not reached those
            # steps; they hold its first request, then answer late)
            await _ask_all(peers, "round/0", only=[straggler])
            await trio.sleep(8.0)
            with trio.move_on_after(0.2):  # it reached step 1; it would hold its partner two periods
                await peers[straggler].group_for("round/1")
            for t in range(2, 6):
                key = f"round/{t}"
                groups, took = await _ask_all(peers, key, only=others)
                stripe = next(s for s in draw_step_groups(peers, key=key, group_size=2) if straggler in s)
                for me in others:
                    assert straggler not in groups[me]
                    if me in stripe:
                        assert took[me] < hold  # told late at once, not held, not the grace
                        assert groups[me] == tuple(sorted(p for p in stripe if p != straggler)) or len(stripe) == 2
            nursery.cancel_scope.cancel()


async def test_a_peer_behind_learns_the_swarms_step_and_pairs_again() -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            # the peer behind holds its partners' requests for their hold, which doubles each step
            # they sync back to back: kept at its least (half the grace), five steps take seconds, not ~25
            peers = await gossip_peers(nursery, 5, grace_s=GRACE_S, max_hold_s=GRACE_S / 2)
            def partners(p: str) -> set[str]:
                return {q for t in range(5) for s in draw_step_groups(peers, key=f"round/{t}", group_size=2)
                        if p in s for q in s if q != p}

            # a peer drawn with at least two others in steps 0..4 (so two peers vouch for the step)
            behind = max(sorted(peers), key=lambda p: len(partners(p)))
            assert len(partners(behind)) >= 2
            others = [p for p in peers if p != behind]
            for t in range(5):  # the others sync steps 0..4 without it (it is slow)
                await _ask_all(peers, f"round/{t}", only=others)
            # from the requests its partners sent it, it knows where the swarm is going
            assert peers[behind].next_step() == 5
            # asking for a step it missed, it is told gone at once
            groups, _ = await _ask_all(peers, "round/1", only=[behind])
            assert groups[behind] == (behind,)
            # jumping there, it is in a group again at the swarm's next step
            groups, _ = await _ask_all(peers, "round/5")
            stripe = next(s for s in draw_step_groups(peers, key="round/5", group_size=2) if behind in s)
            assert groups[behind] == stripe
            nursery.cancel_scope.cancel()


async def test_differing_views_average_only_with_those_who_agree() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            def views(me: str, everyone: list[str]) -> list[str]:
                # the first peer has not seen the last one join yet
                return [p for p in everyone if not (me == everyone[0] and p == everyone[-1])]

            peers = await gossip_peers(nursery, 5, views=views, grace_s=GRACE_S)
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
            peers = await gossip_peers(nursery, 2, grace_s=GRACE_S)
            a, b = list(peers)
            stream = await peers[a].host.new_stream(ID.from_base58(b), [GROUP_PROTOCOL])
            await write_message(stream, {"run": "run", "key": "round/0", "group": ["not-me"]})
            with trio.fail_after(5), pytest.raises(BrokenError):  # closed on us, unanswered
                await read_message(stream)
            groups, _ = await _ask_all(peers, "round/0")
            assert groups[a] == tuple(sorted(peers))
            nursery.cancel_scope.cancel()


async def test_a_partner_behind_by_less_than_a_period_is_waited_for() -> None:
    """Two peers syncing every ~2 s; at one step the first arrives 1.2 s before the other (it
    averaged alone last step, say, and skipped an exchange). Its hold is one of its periods, not
    the 0.75 s half-grace, so the pair is confirmed; before, the second was told late at once
    (its pace put it after the short hold) and both averaged alone."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 2, grace_s=GRACE_S)
            early, behind = sorted(peers)
            for t in range(3):  # a shared pace of ~2 s
                if t:
                    await trio.sleep(2.0)
                await _ask_all(peers, f"round/{t}")
            groups: dict[str, tuple[str, ...]] = {}

            async def ask(me: str, after: float) -> None:
                await trio.sleep(after)
                groups[me] = tuple(await peers[me].group_for("round/3"))

            async with trio.open_nursery() as inner:
                inner.start_soon(ask, early, 0.8)
                inner.start_soon(ask, behind, 2.0)
            assert groups[early] == groups[behind] == (early, behind)
            nursery.cancel_scope.cancel()


async def test_a_peer_that_leaves_answers_held_and_new_requests_gone_at_once() -> None:
    """A peer whose training ended holds nobody: a request it was holding for a step it will
    never open is answered at once (not at the end of the asker's hold), and so is a new one."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 2, grace_s=SLOW_GRACE_S)
            asker, leaver = sorted(peers)
            await peers[leaver].group_for("round/0")
            await peers[asker].group_for("round/0")
            held: list = []

            async def ask_held() -> None:
                held.append(await _ask_all(peers, "round/1", only=[asker]))

            async with trio.open_nursery() as inner:
                inner.start_soon(ask_held)
                await trio.sleep(0.3)  # held (the asker asks for half the grace, 2 s): round/1 is not open there
                assert not held
                peers[leaver].leave()
            groups, took = held[0]
            assert groups[asker] == (asker,)
            assert took[asker] < 1.5  # answered at the leave, not at the hold's end (2 s)
            assert peers[asker].left_out == (f"{leaver[-6:]}: gone (at step 0)",)
            groups, took = await _ask_all(peers, "round/2", only=[asker])
            assert groups[asker] == (asker,)
            assert took[asker] < 1.0
            nursery.cancel_scope.cancel()


async def test_an_avoided_partner_is_drawn_by_nobody_who_refused_it() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            peers = await gossip_peers(nursery, 3, grace_s=GRACE_S)  # groups of 2: one stripe of three
            me, refused, other = sorted(peers)
            groups, _ = await _ask_all(peers, "round/0")
            assert all(len(g) == 3 for g in groups.values())
            peers[me].avoid(refused)
            assert peers[me].avoided() == [refused]
            assert peers[me].proposal("round/1") == tuple(sorted((me, other)))
            groups, _ = await _ask_all(peers, "round/1")
            # the refused partner proposes us still, but our answer does not hold it: unconfirmed
            assert groups[me] == tuple(sorted((me, other)))
            assert me not in groups[refused]
            assert groups[other] == tuple(sorted(peers))
            nursery.cancel_scope.cancel()
