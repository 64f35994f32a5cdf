"""The "behind" rule of the round coordinator and the lag of published records: a peer that
synced with us in the round before is not behind because its record of that round has not
reached us yet (two trainers whose rounds are a fraction of a second apart each ran round 1
alone)."""

from __future__ import annotations

from lattica.coordination.rounds import RoundCoordinator


def _coordinator(me: str, ids: list[str], published: dict[str, int]) -> RoundCoordinator:
    rounds = RoundCoordinator(
        None, peer_id=me, run_id="r", candidates=lambda: ids, deadline_s=5.0,  # type: ignore[arg-type]
        published_round=published.get,
    )
    rounds.responsive = lambda p: True
    return rounds


def test_a_member_of_the_last_round_whose_record_is_late_is_waited_for() -> None:
    published = {"a": 1}  # "a" published round 1; "b"'s record of it is still on its way
    a = _coordinator("a", ["a", "b"], published)
    a._learn("round/0", ("a", "b"))
    assert a._awaited("round/1") == {"a", "b"}  # before: {"a"}, sealed at once without "b"
    b = _coordinator("b", ["a", "b"], {"b": 1})
    b._learn("round/0/retry/1", ("a", "b"))  # a retry's group counts as that round's
    assert b._next_coordinator("round/1", set(), None) == "a"  # before: "b" (each side alone)


def test_a_peer_that_did_not_sync_with_us_and_published_nothing_is_still_catching_up() -> None:
    published = {"a": 3, "c": 3}
    a = _coordinator("a", ["a", "b", "c"], published)
    a._learn("round/2", ("a", "c"))
    assert a._awaited("round/3") == {"a", "c"}  # "b" was not in our last group: fetching
    a._learn("round/1", ("a", "b", "c"))  # a group two rounds back says nothing about now
    assert a._awaited("round/3") == {"a", "c"}
