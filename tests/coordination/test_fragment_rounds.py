"""Fragment syncs (``round/N/fragment/f``, Streaming DiLoCo and its eager variant) and the
"behind" rule of the round coordinator: peers at the same fragment sync may have published round
numbers one apart (a round is P fragment syncs applied) or no record yet (it replicates with a
lag); neither may cost a peer its coordinator role, or each side seals the sync alone."""

from __future__ import annotations

from lattica.coordination.rounds import RoundCoordinator


def _coordinator(me: str, ids: list[str], published: dict[str, int]) -> RoundCoordinator:
    rounds = RoundCoordinator(
        None, peer_id=me, run_id="r", candidates=lambda: ids, deadline_s=5.0,  # type: ignore[arg-type]
        published_round=published.get,
    )
    rounds.responsive = lambda p: True
    return rounds


def test_a_first_record_not_yet_seen_keeps_the_lowest_peer_coordinator_of_a_fragment_sync() -> None:
    # seen from "b" in the two-daemon run: "b" published round 0, "a"'s first record not yet here
    published = {"b": 0}
    b = _coordinator("b", ["a", "b"], published)
    key = "round/1/fragment/1"
    assert b._next_coordinator(key, set(), None) == "a"  # before: "b" (each side sealed alone)
    assert b._awaited(key) == {"a", "b"}
    assert b._outranked(key) == "a"
    # blocking rounds keep their rule: a peer with no record while others have is catching up
    assert b._next_coordinator("round/1", set(), None) == "b"


def test_one_round_apart_is_ordinary_at_a_fragment_sync_two_is_catching_up() -> None:
    published = {"a": 4, "b": 5, "c": 5}
    c = _coordinator("c", ["a", "b", "c"], published)
    assert c._next_coordinator("round/10/fragment/0", set(), None) == "a"
    assert c._next_coordinator("round/5", set(), None) == "b"  # blocking: one behind does not coordinate
    published["a"] = 3  # two behind: fetching the run's state
    assert c._next_coordinator("round/10/fragment/0", set(), None) == "b"
    published["a"] = 2  # three behind: not waited for either
    assert c._awaited("round/10/fragment/0") == {"b", "c"}
    del published["a"]  # no record at all while the swarm is at round 5
    assert c._next_coordinator("round/10/fragment/0", set(), None) == "b"
    assert c._awaited("round/10/fragment/0") == {"b", "c"}
