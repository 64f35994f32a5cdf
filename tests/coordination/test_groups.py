"""The pure core of coordinator-free groups: permutations, stripes, confirmation, answers."""

from __future__ import annotations

import pytest

from lattica.coordination.groups import (
    GONE,
    LATE,
    READY,
    WAIT,
    GossipGroupsConfig,
    GroupHandshakes,
    Reply,
    Request,
    SwarmStep,
    Verdict,
    confirmed_group,
    draw_step_groups,
    handshake_request,
    parse_reply,
    parse_request,
    proposed_group,
    step_of,
    step_order,
)
from lattica.errors import RemoteProtocolError

MEMBERS = ["a", "b", "c", "d", "e"]


def test_order_is_by_hash_of_key_and_peer() -> None:
    # sha256("round/0\0<peer>") begins: a ae385a, b ce67ab, c d53bcb, d b2470d, e f5c763
    assert step_order(MEMBERS, key="round/0") == ["a", "d", "b", "c", "e"]
    # sha256("round/1\0<peer>") begins: a c1a67a, b d3fde9, c 9bd81d, d 8bc351, e 0189a0
    assert step_order(MEMBERS, key="round/1") == ["e", "d", "c", "a", "b"]


def test_stripes_of_two_with_the_leftover_in_the_last() -> None:
    assert draw_step_groups(MEMBERS, key="round/0", group_size=2) == [("a", "d"), ("b", "c", "e")]
    assert draw_step_groups(MEMBERS, key="round/1", group_size=2) == [("d", "e"), ("a", "b", "c")]
    assert draw_step_groups(MEMBERS[:4], key="round/1", group_size=2) == [("c", "d"), ("a", "b")]
    assert draw_step_groups(MEMBERS, key="round/0", group_size=3) == [("a", "b", "d"), ("c", "e")]
    assert draw_step_groups(["a"], key="round/0", group_size=2) == [("a",)]


def test_same_groups_whatever_order_or_duplicates_the_view_holds() -> None:
    a = draw_step_groups(MEMBERS, key="round/7", group_size=2)
    b = draw_step_groups([*reversed(MEMBERS), "c"], key="round/7", group_size=2)
    assert a == b
    assert sorted(p for g in a for p in g) == MEMBERS


def test_groups_are_redrawn_every_step() -> None:
    members = [f"p{i:02d}" for i in range(16)]
    drawn = {tuple(draw_step_groups(members, key=f"round/{t}", group_size=2)) for t in range(20)}
    assert len(drawn) == 20
    partners_of_p00 = {
        g for t in range(20) for g in draw_step_groups(members, key=f"round/{t}", group_size=2) if "p00" in g
    }
    assert len(partners_of_p00) > 5  # p00 mixes with many peers, not a fixed partner


def test_proposal_is_idempotent_on_a_group() -> None:
    for size in (2, 3):
        for t in range(30):
            key = f"round/{t}"
            for me in MEMBERS:
                group = proposed_group(MEMBERS, me, key=key, group_size=size)
                assert me in group
                assert proposed_group(group, me, key=key, group_size=size) == group


def test_proposal_includes_me_even_when_my_view_lacks_me() -> None:
    assert "e" in proposed_group(["a", "b", "c", "d"], "e", key="round/0", group_size=2)


def test_all_agree_when_views_agree() -> None:
    key = "round/0"
    proposals = {p: proposed_group(MEMBERS, p, key=key, group_size=2) for p in MEMBERS}
    for me, proposal in proposals.items():
        answers = {q: proposals[q] for q in proposal if q != me}
        assert confirmed_group(me, proposal, answers) == proposal


def test_a_view_without_a_new_peer_confirms_only_the_pairs_that_agree() -> None:
    # "e" just joined; "b" has not seen it yet. round/0: everyone else draws [a d] [b c e];
    # b draws from [a b c d]: [a d] [b c]
    key = "round/0"
    full = {p: proposed_group(MEMBERS, p, key=key, group_size=2) for p in "acde"}
    full["b"] = proposed_group(["a", "b", "c", "d"], "b", key=key, group_size=2)
    assert full["b"] == ("b", "c")
    assert full["c"] == ("b", "c", "e")

    def confirmed(me: str) -> tuple[str, ...]:
        return confirmed_group(me, full[me], {q: full[q] for q in full[me] if q != me})

    assert confirmed("a") == ("a", "d")
    assert confirmed("d") == ("a", "d")
    assert confirmed("b") == ("b", "c")
    assert confirmed("c") == ("b", "c", "e")  # c agrees with both
    assert confirmed("e") == ("c", "e")  # b does not hold e: e pairs with c only
    # the test is symmetric: p holds q exactly when q holds p
    for p in MEMBERS:
        for q in MEMBERS:
            assert (q in confirmed(p)) == (p in confirmed(q))


def test_silent_or_gone_partner_leaves_me_alone() -> None:
    assert confirmed_group("a", ("a", "d"), {}) == ("a",)
    assert confirmed_group("a", ("a", "d"), {"d": None}) == ("a",)
    assert confirmed_group("b", ("b", "c", "e"), {"c": ("b", "c", "e"), "e": None}) == ("b", "c")


def test_an_answer_that_does_not_hold_me_is_not_a_partner() -> None:
    assert confirmed_group("a", ("a", "d"), {"d": ("d", "x")}) == ("a",)
    assert confirmed_group("a", ("a", "d"), {"x": ("a", "x")}) == ("a",)  # not proposed by me


def test_a_peer_that_left_answers_every_key_gone() -> None:
    book = GroupHandshakes(GossipGroupsConfig(grace_s=2.0))
    book.open("round/3", now=10.0)
    # before leaving: its open key is ready and a step ahead is held
    assert book.decide("round/3", asker="b", asked_at=10.5, now=10.5) == Verdict(READY)
    assert book.decide("round/4", asker="b", asked_at=10.5, now=10.5).kind == WAIT
    book.leave()
    assert book.left
    for key in ("round/3", "round/4", "round/9"):
        assert book.decide(key, asker="b", asked_at=10.5, now=10.5) == Verdict(GONE)
    assert book.answer("round/4", ("a", "b"), Verdict(GONE), asker="b") == {"gone": True, "step": 3}


def test_handshakes_answer_until_gone() -> None:
    book = GroupHandshakes(GossipGroupsConfig(grace_s=2.0))
    hold = book.open("round/3", now=10.0)
    assert hold == 1.0  # no pace yet: hold_s
    # open for the hold it asked its partners for plus the grace: a partner it held may answer
    # ready at the end of that hold and then ask in turn
    ready = book.decide("round/3", asker="b", asked_at=12.9, now=12.9)
    assert ready == Verdict(READY)
    assert book.answer("round/3", ("a", "b"), ready, asker="b") == {"group": ["a", "b"], "step": 3}
    gone = book.decide("round/3", asker="b", asked_at=13.1, now=13.1)  # averaged and moved on
    assert gone == Verdict(GONE)
    assert book.answer("round/3", ("a", "b"), gone, asker="b") == {"gone": True, "step": 3}
    book.open("round/4", now=13.0)
    assert book.gone("round/3", now=13.0)
    assert not book.gone("round/4", now=13.0)
    assert book.gone("round/2", now=13.0)  # an older step: never again
    assert not book.gone("round/5", now=13.0)
    # keys that name no step are answered at once, reached or not
    assert book.decide("other/1", asker="b", asked_at=0.0, now=0.0) == Verdict(READY)


def test_a_step_not_reached_is_held_then_late() -> None:
    config = GossipGroupsConfig(grace_s=4.0, ready_wait_s=1.0)
    book = GroupHandshakes(config)
    # nothing opened yet: held for the hold, then late (and the asker is declined for the key)
    assert book.decide("round/0", asker="b", asked_at=0.0, now=0.0) == Verdict(WAIT, 1.0)
    late = book.decide("round/0", asker="b", asked_at=0.0, now=1.0)
    assert late == Verdict(LATE)
    assert book.answer("round/0", ("a", "b"), late, asker="b") == {"late": True}
    assert book.declined("round/0") == {"b"}
    # once declined, always late for that asker and key, even after reaching the step
    book.open("round/0", now=1.5)
    assert book.decide("round/0", asker="b", asked_at=1.6, now=1.6) == Verdict(LATE)
    assert book.decide("round/0", asker="c", asked_at=1.6, now=1.6) == Verdict(READY)
    # with no pace known yet, any later step is held (a peer behind jumps to the asked step)
    assert book.decide("round/1", asker="c", asked_at=2.0, now=2.0) == Verdict(WAIT, 3.0)
    assert book.decide("round/7", asker="c", asked_at=2.0, now=2.0) == Verdict(WAIT, 3.0)


def test_the_hold_is_at_most_half_the_grace() -> None:
    assert GossipGroupsConfig(grace_s=5.0).hold_s == 2.5
    assert GossipGroupsConfig(grace_s=5.0, ready_wait_s=1.0).hold_s == 1.0
    assert GossipGroupsConfig(grace_s=1.0, ready_wait_s=3.0).hold_s == 0.5


def test_the_hold_asked_for_is_two_of_the_askers_longest_recent_periods() -> None:
    config = GossipGroupsConfig(grace_s=4.0, max_hold_s=30.0)
    assert config.hold_for(None) == 2.0  # pace not known yet: hold_s
    assert config.hold_for(0.5) == 2.0  # at least hold_s
    assert config.hold_for(6.0) == 12.0  # two step periods
    assert config.hold_for(100.0) == 30.0  # at most max_hold_s
    book = GroupHandshakes(config)
    assert book.open("round/0", now=0.0) == 2.0
    assert book.open("round/1", now=6.0) == 12.0  # its pace is now 6 s
    assert book.open("round/1", now=7.0) == 12.0  # the same key: the same hold
    # the key stays open for that hold plus the grace
    assert book.decide("round/1", asker="b", asked_at=21.9, now=21.9) == Verdict(READY)
    assert book.decide("round/1", asker="b", asked_at=22.1, now=22.1) == Verdict(GONE)
    # two short steps (it averaged alone) do not shrink the hold below its longest recent
    # interval: partners coming out of a full exchange are still waited for
    book.open("round/2", now=7.0)
    book.open("round/3", now=8.0)
    assert book.pace is not None
    assert book.pace < 6.0
    assert book.hold_pace == 6.0
    assert book.open("round/4", now=9.0) == 12.0
    # after four short ones the long interval has left the window
    assert book.open("round/5", now=10.0) == 2 * book.pace


def test_a_partner_early_by_less_than_a_period_is_held_for_it() -> None:
    """The asker averaged alone last step, so it arrives a long exchange early: the answerer is
    on its way (its pace puts it 7 s off) and the asker's period is 10 s, so it holds the request
    instead of answering late (a fixed half-grace hold said late: both alone again)."""
    book = GroupHandshakes(GossipGroupsConfig(grace_s=5.0))
    for t in range(4):
        book.open(f"round/{t}", now=10.0 * t)  # one sync every 10 s (a long exchange)
    assert book.decide("round/4", asker="b", asked_at=33.0, now=33.0, hold_s=10.0) == Verdict(WAIT, 43.0)
    # it opens the step within the hold: the held request is answered ready
    book.open("round/4", now=40.0)
    assert book.decide("round/4", asker="b", asked_at=33.0, now=40.0, hold_s=10.0) == Verdict(READY)
    # a straggler relative to the asker (ten times its period) is still told late at once
    slow = GroupHandshakes(GossipGroupsConfig(grace_s=5.0))
    for t in range(4):
        slow.open(f"round/{t}", now=100.0 * t)
    assert slow.decide("round/4", asker="b", asked_at=320.0, now=320.0, hold_s=10.0) == Verdict(LATE)
    # a requested hold is capped by the answerer's max_hold_s
    capped = GroupHandshakes(GossipGroupsConfig(grace_s=5.0, max_hold_s=4.0))
    assert capped.decide("round/0", asker="b", asked_at=0.0, now=0.0, hold_s=50.0) == Verdict(WAIT, 4.0)


def test_a_partner_the_asker_did_not_confirm_is_declined_both_ways() -> None:
    """``a`` asked ``b`` and stopped waiting before ``b``'s ready answer came: ``a`` averages
    alone, so when ``b`` asks ``a`` in turn it must be told late (before, ``a`` answered ready:
    ``b`` counted ``a`` in its group and then waited out its exchange)."""
    config = GossipGroupsConfig(grace_s=4.0)
    a, b = GroupHandshakes(config), GroupHandshakes(config)
    a.open("round/0", now=0.0)
    assert a.settle("round/0", "a", ("a", "b", "c"), {"c": Reply(("a", "c"), 0)}) == ("a", "c")
    assert a.declined("round/0") == {"b"}
    b.open("round/0", now=5.0)
    verdict = a.decide("round/0", asker="b", asked_at=5.0, now=5.0)
    assert verdict == Verdict(LATE)
    reply = parse_reply(a.answer("round/0", ("a", "b", "c"), verdict, asker="b"), peer_id="a")
    assert b.settle("round/0", "b", ("a", "b", "c"), {"a": reply, "c": Reply(("a", "b", "c"), 0)}) == ("b", "c")
    assert "a" in b.declined("round/0")
    # a partner whose proposal does not hold this peer, or that answered late, is out too
    c = GroupHandshakes(config)
    c.open("round/0", now=0.0)
    answers = {"a": Reply(("a", "x"), 0), "b": Reply(None, 0, late=True)}
    assert c.settle("round/0", "c", ("a", "b", "c"), answers) == ("c",)
    assert c.declined("round/0") == {"a", "b"}


def test_a_slow_peer_answers_late_at_once_from_its_pace() -> None:
    book = GroupHandshakes(GossipGroupsConfig(grace_s=5.0, ready_wait_s=1.0))
    for t in range(4):
        book.open(f"round/{t}", now=20.0 * t)  # one sync every 20 s
    assert book.pace == 20.0
    # asked for its next step 2 s after its last sync: it arrives in ~18 s, after the hold
    assert book.decide("round/4", asker="b", asked_at=62.0, now=62.0) == Verdict(LATE)
    # however far the step asked for: its next sync is not due within the hold
    assert book.decide("round/40", asker="b", asked_at=62.0, now=62.0) == Verdict(LATE)
    # asked 19.5 s after: it is due within the hold, so the request is held
    assert book.decide("round/4", asker="b", asked_at=79.5, now=79.5) == Verdict(WAIT, 80.5)
    # overdue (it was frozen, say): held, not refused
    assert book.decide("round/9", asker="b", asked_at=200.0, now=200.0) == Verdict(WAIT, 201.0)
    # one long interval (frozen for 100 s) counts as three paces: back in step, it is held
    # for an asker whose period is its own again within a step, not told late for many steps
    thawed = GroupHandshakes(GossipGroupsConfig(grace_s=5.0, ready_wait_s=1.0))
    for t in range(4):
        thawed.open(f"round/{t}", now=2.0 * t)
    thawed.open("round/4", now=106.0)
    assert thawed.pace == pytest.approx(0.3 * 6.0 + 0.7 * 2.0)
    assert thawed.decide("round/5", asker="b", asked_at=106.5, now=106.5, hold_s=3.0).kind == WAIT
    # a fast peer (1 s per sync) asked for its next step is held too
    fast = GroupHandshakes(GossipGroupsConfig(grace_s=5.0, ready_wait_s=1.0))
    for t in range(4):
        fast.open(f"round/{t}", now=1.0 * t)
    assert fast.decide("round/4", asker="b", asked_at=3.2, now=3.2).kind == WAIT


def test_late_verdicts_agree_on_both_sides() -> None:
    """The straggler ``s`` tells ``a`` late; ``a`` leaves ``s`` out, and ``s`` leaves ``a`` out
    when it reaches the step, so neither waits for the other in an exchange."""
    config = GossipGroupsConfig(grace_s=4.0, ready_wait_s=1.0)
    a, s = GroupHandshakes(config), GroupHandshakes(config)
    a.open("round/0", now=0.0)
    s.open("round/0", now=0.0)
    a.open("round/1", now=10.0)
    verdict = s.decide("round/1", asker="a", asked_at=10.0, now=11.0)
    reply = parse_reply(s.answer("round/1", ("a", "s"), verdict, asker="a"), peer_id="s")
    assert reply == Reply(None, 0, late=True)
    a.decline("round/1", "s")  # what the shell does with a late reply
    s.open("round/1", now=30.0)
    assert confirmed_group("a", ("a", "s"), {"s": None}) == ("a",)
    # s would ask a: a answers it late (declined), and s has declined a itself
    assert a.decide("round/1", asker="s", asked_at=12.0, now=12.0) == Verdict(LATE)
    assert "a" in s.declined("round/1")


def test_swarm_step_needs_two_peers_to_move_anyone() -> None:
    swarm = SwarmStep(remembered=4)
    assert swarm.next_step(members=8) is None
    swarm.heard("x", 10**9)  # one peer announcing a far step
    assert swarm.next_step(members=8) is None
    swarm.heard("b", 40)
    assert swarm.next_step(members=8) is None  # nobody vouches for either
    swarm.heard("c", 38)  # within two steps of b: b's step stands
    assert swarm.next_step(members=8) == 41
    swarm.heard("c", 42)  # the freshest step that another peer backs (b at 40)
    assert swarm.next_step(members=8) == 43
    swarm.heard("b", 30)  # steps only grow per peer
    assert swarm.next_step(members=8) == 43
    swarm.heard("d", 1)
    swarm.heard("e", 2)  # x is forgotten (the last 4 peers are kept)
    assert swarm.next_step(members=8) == 43
    # with a single other member, its step is enough
    pair = SwarmStep()
    pair.heard("b", 7)
    assert pair.next_step(members=2) == 8
    # in a view of up to four, the others may have been heard steps apart (one of them long
    # ago, a peer hearing about one partner per step): the highest step heard stands
    small = SwarmStep()
    small.heard("b", 1)
    small.heard("c", 7)
    assert small.next_step(members=3) == 8
    assert small.next_step(members=4) == 8
    assert small.next_step(members=5) is None


def test_handshakes_remember_a_bounded_number_of_keys() -> None:
    book = GroupHandshakes(GossipGroupsConfig(remembered_keys=3))
    for i in range(10):
        book.open(f"other/{i}", now=float(i))
    assert len(book._opened) == 3


def test_messages_round_trip_and_bad_ones_are_remote_errors() -> None:
    request = handshake_request("run", "round/1", ("a", "b"))
    assert parse_request(request, run_id="run", peer_id="a") == Request("round/1", ("a", "b"))
    request = handshake_request("run", "round/1", ("a", "b"), hold_s=7.5)
    assert parse_request(request, run_id="run", peer_id="a") == Request("round/1", ("a", "b"), 7.5)
    assert parse_reply({"group": ["a", "b"]}, peer_id="b") == Reply(("a", "b"))
    assert parse_reply({"group": ["a", "b"], "step": 4}, peer_id="b") == Reply(("a", "b"), 4)
    assert parse_reply({"gone": True}, peer_id="b") == Reply(None)
    assert parse_reply({"late": True, "step": 2}, peer_id="b") == Reply(None, 2, late=True)
    bad_requests: list[object] = [
        None, [], {"run": "other", "key": "round/1", "group": ["a"]},
        {"run": "run", "key": "", "group": ["a"]}, {"run": "run", "key": "x" * 201, "group": ["a"]},
        {"run": "run", "key": "round/1", "group": ["b"]},  # sender not in its own proposal
        {"run": "run", "key": "round/1", "group": ["a"] * 65},
        {"run": "run", "key": "round/1", "group": ["a", 3]},
        {"run": "run", "key": "round/1", "group": ["a"], "hold": -1.0},
        {"run": "run", "key": "round/1", "group": ["a"], "hold": float("nan")},
        {"run": "run", "key": "round/1", "group": ["a"], "hold": 1e9},
        {"run": "run", "key": "round/1", "group": ["a"], "hold": True},
        {"run": "run", "key": "round/1", "group": ["a"], "hold": "5"},
    ]
    for bad in bad_requests:
        with pytest.raises(RemoteProtocolError) as info:
            parse_request(bad, run_id="run", peer_id="a")
        assert info.value.peer_id == "a"
    for bad_reply in (
        None, {"group": "ab"}, {"gone": 1}, {"group": []}, {"gone": True, "step": -1},
        {"gone": True, "step": "3"}, {"group": ["a"], "step": True}, {"late": True, "step": 2**60},
    ):
        with pytest.raises(RemoteProtocolError):
            parse_reply(bad_reply, peer_id="b")


def test_step_of_keys() -> None:
    assert step_of("round/12") == 12
    assert step_of("round/12/fragment/1") == 12
    assert step_of("round/x") is None
    assert step_of("other/1") is None


def test_config_is_validated() -> None:
    for bad in ({"group_size": 1}, {"group_size": 33}, {"grace_s": 0}, {"remembered_keys": 0}, {"ready_wait_s": -1},
                {"max_hold_s": 0}, {"max_hold_s": 1e9}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GossipGroupsConfig(**bad)  # type: ignore[arg-type]


def test_a_peer_two_steps_behind_counts_both_steps_to_the_one_asked_for() -> None:
    """Asked for step 6 while its latest is 4 (pace 5 s): it opens 5, then 6, two paces away
    (10 s) — past an asker's 8 s hold, so ``late`` at once instead of holding the asker 8 s for
    nothing; one step behind it would be held. Only when its next key is three or more below the
    swarm's round does it jump (to the swarm's next step), so its next sync may be the one asked
    for."""
    book = GroupHandshakes(GossipGroupsConfig(grace_s=5.0))
    for t in range(5):
        book.open(f"round/{t}", now=5.0 * t)  # latest step 4 at t = 20, pace 5 s
    assert book.decide("round/6", asker="b", asked_at=20.5, now=20.5, hold_s=8.0) == Verdict(LATE)
    assert book.decide("round/5", asker="c", asked_at=20.5, now=20.5, hold_s=8.0) == Verdict(WAIT, 28.5)
    # three behind, in step with the swarm as it knows it: it opens 5, 6, 7 first (15 s away)
    assert book.decide("round/7", asker="d", asked_at=20.5, now=20.5, hold_s=8.0, swarm_next=8) == Verdict(LATE)
    # far behind the swarm (at round 9): it jumps there next, so its next sync is the one asked for
    assert book.decide("round/10", asker="e", asked_at=20.5, now=20.5, hold_s=8.0, swarm_next=10) == Verdict(
        WAIT, 28.5
    )
    # ... and a step below where it jumps to it never opens
    assert book.decide("round/9", asker="f", asked_at=20.5, now=20.5, hold_s=8.0, swarm_next=10) == Verdict(LATE)


def test_a_straggler_has_a_pace_from_its_first_sync_when_its_start_is_known() -> None:
    """Its first inner phase took 50 s: asked for its next step by a peer whose hold is 8 s, it
    says ``late`` at once. Without the start it had no pace until its second sync, and every
    partner drawn with it waited out its hold."""
    book = GroupHandshakes(GossipGroupsConfig(grace_s=5.0))
    book.begin(0.0)
    book.open("round/0", now=50.0)
    assert book.pace == 50.0
    assert book.decide("round/1", asker="b", asked_at=55.0, now=55.0, hold_s=8.0) == Verdict(LATE)
    unknown = GroupHandshakes(GossipGroupsConfig(grace_s=5.0))
    unknown.open("round/0", now=50.0)
    assert unknown.decide("round/1", asker="b", asked_at=55.0, now=55.0, hold_s=8.0) == Verdict(WAIT, 63.0)
