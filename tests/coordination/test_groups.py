"""The pure core of coordinator-free groups: permutations, stripes, confirmation, answers."""

from __future__ import annotations

import pytest

from lattica.coordination.groups import (
    GossipGroupsConfig,
    GroupHandshakes,
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
    partners_of_p00 = {g for t in range(20) for g in draw_step_groups(members, key=f"round/{t}", group_size=2) if "p00" in g}
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


def test_handshakes_answer_until_gone() -> None:
    book = GroupHandshakes(GossipGroupsConfig(grace_s=2.0))
    # not reached yet: answered with the proposal at once (the asker waits in its exchange)
    assert book.answer("round/3", ("a", "b"), now=0.0) == {"group": ["a", "b"]}
    book.open("round/3", now=10.0)
    assert book.answer("round/3", ("a", "b"), now=11.9) == {"group": ["a", "b"]}
    assert book.answer("round/3", ("a", "b"), now=12.1) == {"gone": True}  # averaged and moved on
    book.open("round/4", now=13.0)
    assert book.gone("round/3", now=13.0)
    assert not book.gone("round/4", now=13.0)
    assert book.gone("round/2", now=13.0)  # an older step: never again
    assert not book.gone("round/5", now=13.0)


def test_handshakes_remember_a_bounded_number_of_keys() -> None:
    book = GroupHandshakes(GossipGroupsConfig(remembered_keys=3))
    for i in range(10):
        book.open(f"other/{i}", now=float(i))
    assert len(book._opened) == 3


def test_messages_round_trip_and_bad_ones_are_remote_errors() -> None:
    request = handshake_request("run", "round/1", ("a", "b"))
    assert parse_request(request, run_id="run", peer_id="a") == ("round/1", ("a", "b"))
    assert parse_reply({"group": ["a", "b"]}, peer_id="b") == ("a", "b")
    assert parse_reply({"gone": True}, peer_id="b") is None
    bad_requests: list[object] = [
        None, [], {"run": "other", "key": "round/1", "group": ["a"]},
        {"run": "run", "key": "", "group": ["a"]}, {"run": "run", "key": "x" * 201, "group": ["a"]},
        {"run": "run", "key": "round/1", "group": ["b"]},  # sender not in its own proposal
        {"run": "run", "key": "round/1", "group": ["a"] * 65},
        {"run": "run", "key": "round/1", "group": ["a", 3]},
    ]
    for bad in bad_requests:
        with pytest.raises(RemoteProtocolError) as info:
            parse_request(bad, run_id="run", peer_id="a")
        assert info.value.peer_id == "a"
    for bad_reply in (None, {"group": "ab"}, {"gone": 1}, {"group": []}):
        with pytest.raises(RemoteProtocolError):
            parse_reply(bad_reply, peer_id="b")


def test_step_of_keys() -> None:
    assert step_of("round/12") == 12
    assert step_of("round/12/fragment/1") == 12
    assert step_of("round/x") is None
    assert step_of("other/1") is None


def test_config_is_validated() -> None:
    for bad in ({"group_size": 1}, {"group_size": 33}, {"grace_s": 0}, {"remembered_keys": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GossipGroupsConfig(**bad)  # type: ignore[arg-type]
