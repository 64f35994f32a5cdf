"""RoundCoordinator on three real in-process libp2p hosts on loopback."""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.coordination.rounds import (
    ROUND_PROTOCOL,
    RoundCoordinator,
    _CoordinatorSearch,
    round_of,
)
from lattica.net.host import build_host

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    with trio.CancelScope() as scope:
        async with host.run(LOOPBACK):
            task_status.started(scope)
            await trio.sleep_forever()


class _Member:
    def __init__(self, host, scope: trio.CancelScope, coordinator: RoundCoordinator) -> None:
        self.host, self.scope, self.coordinator = host, scope, coordinator
        self.peer_id = coordinator.peer_id


async def _members(
    nursery: trio.Nursery, *, deadline_s: float, count: int = 3, silent: set[str] | None = None,
    silent_for: dict[str, set[str]] | None = None, unlisted_for: dict[str, set[str]] | None = None,
) -> list[_Member]:
    """``count`` connected members, sorted by peer id (the first coordinates every key).
    ``silent``: peers no one finds responsive; ``silent_for[me]``: peers ``me`` alone does not;
    ``unlisted_for[me]``: peers missing from ``me``'s candidates (its view of the members lags)."""
    ids: list[str] = []
    members = []
    for _ in range(count):
        host = build_host(create_new_key_pair())
        scope = await nursery.start(_run_host, host)
        peer_id = host.get_id().to_base58()
        ids.append(peer_id)
        coordinator = RoundCoordinator(
            host, peer_id=peer_id, run_id="test-run", candidates=_listed(peer_id, ids, unlisted_for),
            deadline_s=deadline_s, responsive=_view(peer_id, silent, silent_for),
        )
        await nursery.start(coordinator.run)
        members.append(_Member(host, scope, coordinator))
    for i, member in enumerate(members):
        for other in members[i + 1 :]:
            await member.host.connect(info_from_p2p_addr(other.host.get_addrs()[0]))
    return sorted(members, key=lambda m: m.peer_id)


def _listed(me: str, ids: list[str], unlisted_for: dict[str, set[str]] | None):
    return lambda: [p for p in ids if p not in (unlisted_for or {}).get(me, set())]


def _view(me: str, silent: set[str] | None, silent_for: dict[str, set[str]] | None):
    if silent is None and silent_for is None:
        return None
    return lambda p: p not in (silent or set()) and p not in (silent_for or {}).get(me, set())


async def _groups(members: list[_Member], key: str) -> dict[str, tuple[str, ...]]:
    groups: dict[str, tuple[str, ...]] = {}

    async def ask(member: _Member) -> None:
        groups[member.peer_id] = tuple(await member.coordinator.group_for(key))

    async with trio.open_nursery() as nursery:
        for member in members:
            nursery.start_soon(ask, member)
    return groups


async def test_everyone_gets_the_same_sorted_group() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            members = await _members(nursery, deadline_s=20)
            expected = tuple(sorted(m.peer_id for m in members))
            for key in ("round/0", "round/1"):
                started = trio.current_time()
                groups = await _groups(members, key)
                assert set(groups.values()) == {expected}
                assert trio.current_time() - started < 10  # sealed when all were ready, not at the deadline
            nursery.cancel_scope.cancel()


async def test_a_late_peer_gets_a_group_without_itself_and_syncs_alone() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            members = await _members(nursery, deadline_s=1.0)
            early, late = members[:2], members[2]
            groups = await _groups(early, "round/0")
            assert set(groups.values()) == {(early[0].peer_id, early[1].peer_id)}
            assert tuple(await late.coordinator.group_for("round/0")) == (late.peer_id,)
            nursery.cancel_scope.cancel()


async def test_a_dead_coordinator_hands_over_to_the_next_peer_id() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            # the deadline must exceed the time to give up on a dead coordinator (3 s)
            members = await _members(nursery, deadline_s=5.0)
            dead, alive = members[0], members[1:]
            dead.scope.cancel()  # its host closes; the others still list it as a candidate
            await trio.sleep(0.5)
            groups = await _groups(alive, "round/0")
            assert set(groups.values()) == {tuple(m.peer_id for m in alive)}
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # on a loaded machine py-libp2p can take >20 s to drop a closed host's connection
async def test_the_coordinator_does_not_wait_for_a_candidate_it_lost_the_connection_to() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            # a killed peer stays a candidate (its lease has not run out), but it is gone
            members = await _members(nursery, deadline_s=30.0)
            coordinator, dead, other = members
            dead.scope.cancel()
            with trio.fail_after(20):
                while dead.peer_id in {p.to_base58() for p in coordinator.host.get_connected_peers()}:
                    await trio.sleep(0.05)
            started = trio.current_time()
            groups = await _groups([coordinator, other], "round/0")
            assert set(groups.values()) == {(coordinator.peer_id, other.peer_id)}
            assert trio.current_time() - started < 15  # sealed when the connected ones were ready
            nursery.cancel_scope.cancel()


async def test_a_silent_peer_is_neither_asked_nor_waited_for() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            silent: set[str] = set()
            members = await _members(nursery, deadline_s=30.0, silent=silent)
            cut, rest = members[0], members[1:]  # the would-be coordinator
            silent.add(cut.peer_id)  # connected, but its lease renewals stopped arriving
            started = trio.current_time()
            groups = await _groups(rest, "round/0")
            assert set(groups.values()) == {tuple(m.peer_id for m in rest)}
            assert trio.current_time() - started < 15  # not held until the deadline
            nursery.cancel_scope.cancel()


async def test_askers_stop_waiting_for_a_coordinator_that_turns_silent() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            silent: set[str] = set()
            members = await _members(nursery, deadline_s=30.0, silent=silent)
            coordinator, rest = members[0], members[1:]

            async def turn_silent() -> None:
                await trio.sleep(1.0)  # both wait on the coordinator, which waits for itself
                silent.add(coordinator.peer_id)

            started = trio.current_time()
            async with trio.open_nursery() as silencing:
                silencing.start_soon(turn_silent)
                groups = await _groups(rest, "round/0")
            assert set(groups.values()) == {tuple(m.peer_id for m in rest)}
            assert trio.current_time() - started < 15
            nursery.cancel_scope.cancel()


async def test_a_retry_waits_only_for_the_members_of_the_failed_attempt() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            members = await _members(nursery, deadline_s=8.0)
            pair, absent = members[:2], members[2]  # the third is training on, never asks
            first = await _groups(pair, "round/0")  # sealed at the deadline, without it
            assert set(first.values()) == {(pair[0].peer_id, pair[1].peer_id)}
            started = trio.current_time()
            retry = await _groups(pair, "round/0/retry/1")  # the all-reduce of round/0 failed
            assert set(retry.values()) == {(pair[0].peer_id, pair[1].peer_id)}
            assert trio.current_time() - started < 4  # not held for the absent one until the deadline
            assert absent.peer_id not in retry[pair[0].peer_id]
            nursery.cancel_scope.cancel()


async def test_a_round_does_not_wait_for_peers_already_asking_for_a_later_one() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            members = await _members(nursery, deadline_s=30.0)
            coordinator, ahead, behind = members
            later: dict[str, tuple[str, ...]] = {}

            async def ask_later(member: _Member) -> None:
                later[member.peer_id] = tuple(await member.coordinator.group_for("round/6"))

            async with trio.open_nursery() as asking:
                for member in (coordinator, ahead):
                    asking.start_soon(ask_later, member)
                while len(getattr(coordinator.coordinator._syncs.get("round/6"), "ready", ())) < 2:
                    await trio.sleep(0.05)  # both wait for the third in round 6
                started = trio.current_time()
                # the third is behind: nobody else comes to round 5, so it is not held there
                assert tuple(await behind.coordinator.group_for("round/5")) == (behind.peer_id,)
                assert trio.current_time() - started < 15
                await behind.coordinator.group_for("round/6")
            assert set(later.values()) == {tuple(m.peer_id for m in members)}
            nursery.cancel_scope.cancel()


def test_round_keys_are_ordered_only_for_blocking_rounds() -> None:
    assert round_of("round/12") == 12
    assert round_of("round/12/retry/1") == 12
    assert round_of("round/12/fragment/2") is None
    assert round_of("step/3") is None


async def test_a_peer_that_goes_silent_after_asking_is_left_out_of_the_group() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            silent: set[str] = set()
            members = await _members(nursery, deadline_s=3.0, silent=silent)
            coordinator, cut, absent = members  # the third never asks: sealed at the deadline
            groups: dict[str, tuple[str, ...]] = {}

            async def ask(member: _Member) -> None:
                groups[member.peer_id] = tuple(await member.coordinator.group_for("round/0"))

            async with trio.open_nursery() as asking:
                for member in (coordinator, cut):
                    asking.start_soon(ask, member)
                while len(getattr(coordinator.coordinator._syncs.get("round/0"), "ready", ())) < 2:
                    await trio.sleep(0.05)
                silent.add(cut.peer_id)  # its link is cut while the round waits for the third
            assert groups[coordinator.peer_id] == (coordinator.peer_id,)
            assert groups[cut.peer_id] == (cut.peer_id,)
            assert absent.peer_id not in groups
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("unheard", ["silent_for", "unlisted_for"])
async def test_a_coordinator_that_sees_a_lower_one_redirects_its_askers_there(unheard: str) -> None:
    """The highest peer does not reach the lowest one yet, which the middle one hears. Either
    it does not hear the lowest (back from a restart: ``silent_for``), and the middle one would
    otherwise wait for it until the deadline; or it does not list the lowest among its
    candidates (back from a link cut, the lease looks expired until a renewal arrives:
    ``unlisted_for``), and must follow the middle one's redirect there rather than ask the
    middle one again and again until the round is over without it. One group, at once."""
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            left_out: dict[str, set[str]] = {}
            members = await _members(nursery, deadline_s=20.0, **{unheard: left_out})
            low, _middle, high = members
            left_out[high.peer_id] = {low.peer_id}
            started = trio.current_time()
            groups = await _groups(members, "round/0")
            assert set(groups.values()) == {tuple(m.peer_id for m in members)}
            assert trio.current_time() - started < 10  # one group, not two halves at the deadline
            nursery.cancel_scope.cancel()


async def test_a_coordinator_catching_up_does_not_hold_a_later_round_for_itself() -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            members = await _members(nursery, deadline_s=20.0)
            rest = members[1:]  # the first coordinates
            await _groups(members, "round/3")  # everyone at round 3
            # the others went on to round 6 while the coordinator was cut off; it is catching up
            started = trio.current_time()
            groups = await _groups(rest, "round/6")
            assert set(groups.values()) == {tuple(m.peer_id for m in rest)}
            assert trio.current_time() - started < 10
            nursery.cancel_scope.cancel()


def test_the_next_coordinator_is_looked_up_afresh_after_each_failure() -> None:
    ids = ["a", "b", "c"]
    silent = {"a"}
    rounds = RoundCoordinator(
        None, peer_id="c", run_id="r", candidates=lambda: ids, deadline_s=5.0,  # type: ignore[arg-type]
        responsive=lambda p: p not in silent,
    )
    assert rounds._next_coordinator("round/1", set(), None) == "b"
    silent.clear()  # "a" is heard again while we asked "b", which failed
    assert rounds._next_coordinator("round/1", {"b"}, None) == "a"
    assert rounds._next_coordinator("round/1", {"a", "b"}, None) == "c"
    assert rounds._next_coordinator("round/1", {"a", "b", "c"}, None) is None
    assert rounds._next_coordinator("round/1", {"c"}, "b") == "b"  # redirected
    assert rounds._next_coordinator("round/1", set(), "0") == "0"  # also to a peer we do not list (yet)
    rounds._learn("round/1", ("b", "c"))  # a retry asks among the failed attempt's members
    assert rounds._next_coordinator("round/1/retry/1", set(), None) == "b"


def test_a_candidate_catching_up_neither_coordinates_nor_is_waited_for() -> None:
    ids = ["a", "b", "c", "d"]
    published = {"a": 7, "b": 9, "c": 10, "d": 10}  # "a" is back from a restart, fetching
    rounds = RoundCoordinator(
        None, peer_id="c", run_id="r", candidates=lambda: ids, deadline_s=5.0,  # type: ignore[arg-type]
        published_round=published.get,
    )
    rounds.responsive = lambda p: True
    assert rounds._behind() == {"a"}
    assert rounds._awaited("round/10") == {"b", "c", "d"}  # one behind: an ordinary lag
    # but only the up-to-date coordinate: "c" (itself) is the lowest of them
    assert rounds._next_coordinator("round/10", set(), None) == "c"
    assert rounds._outranked("round/10") is None
    published["a"] = 10  # caught up
    assert rounds._next_coordinator("round/10", set(), None) == "a"
    assert rounds._outranked("round/10") == "a"
    del published["b"]  # a record not published yet while others have: not up to date
    assert rounds._behind() == {"b"}
    published.update(b=9)
    published.update(a=14)  # one peer ahead (running alone): the others are not behind it
    assert rounds._behind() == set()
    assert rounds._next_coordinator("round/10", set(), None) == "a"
    published.clear()  # the start of a run: nobody has published, nobody is behind
    assert rounds._behind() == set()


async def test_survivors_of_a_coordinator_that_dies_while_asked_meet_in_one_round() -> None:
    """The lowest peer dies while both survivors ask for a round, and they notice at different
    times: the middle one still asks it, the highest already does not. The middle one redirects
    the highest there; both asks then fail. The highest must come back to the middle one (it only
    redirected, it did not fail) instead of syncing alone while the middle one waits for it."""
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            silent_for: dict[str, set[str]] = {}
            members = await _members(nursery, deadline_s=4.0, silent_for=silent_for)
            dying, middle, high = members
            dying.coordinator.host.set_stream_handler(ROUND_PROTOCOL, _dies_after(1.0))
            silent_for[high.peer_id] = {dying.peer_id}  # the highest already saw it go
            groups = await _groups([middle, high], "round/0")
            assert set(groups.values()) == {(middle.peer_id, high.peer_id)}
            nursery.cancel_scope.cancel()


def _dies_after(seconds: float):
    """A round handler that holds the stream ``seconds`` unanswered, then resets it,
    as a coordinator whose process dies while it is being asked."""

    async def handle(stream) -> None:
        await trio.sleep(seconds)
        await stream.reset()

    return handle


def test_a_coordinator_that_only_redirected_is_asked_again() -> None:
    ids = ["a", "b", "c"]
    rounds = RoundCoordinator(
        None, peer_id="c", run_id="r", candidates=lambda: ids, deadline_s=5.0,  # type: ignore[arg-type]
        responsive=lambda p: p != "a",  # "c" already saw "a" go; "b" has not yet
    )
    search = _CoordinatorSearch(patience_s=5.0)
    assert rounds._next_coordinator("round/1", search.failed, search.take_redirect()) == "b"
    assert not search.on_redirect("b", "a", now=0.0)  # "b" still hears "a": we follow
    assert rounds._next_coordinator("round/1", search.failed, search.take_redirect()) == "a"
    search.on_failure("a")  # it is dead
    # "b" only redirected: it is next again, not ourselves alone (a split round)
    assert rounds._next_coordinator("round/1", search.failed, search.take_redirect()) == "b"
    assert search.on_redirect("b", "a", now=1.0)  # its view lags: ask it again after a pause
    assert rounds._next_coordinator("round/1", search.failed, search.take_redirect()) == "b"
    assert search.on_redirect("b", "a", now=3.0)
    assert not search.on_redirect("b", "a", now=6.0)  # a whole deadline of it: "b" failed too
    assert rounds._next_coordinator("round/1", search.failed, search.take_redirect()) == "c"
