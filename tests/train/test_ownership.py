"""SPES expert ownership read from and published to the replicated state (pure parts + a fake)."""

from lattica.train.swarm.membership import MembershipView
from lattica.train.swarm.ownership import ReplicatedOwnership, claimed_owners


class FakeState:
    def __init__(self, experts):
        self.experts = experts
        self.writes = []

    def snapshot(self):
        return {"experts": self.experts}

    async def set_owned_experts(self, experts):
        self.writes.append(list(experts))


def test_claims_of_live_members_win_conflicts_by_lowest_id_and_junk_is_ignored():
    snapshot = {
        "experts": {
            "0": ["b", "a"],  # claimed twice: lowest id
            "1": ["gone"],  # not live
            "2": ["c"],
            "9": ["a"],  # out of range
            "x": ["a"],  # not an expert id
            "3": "a",  # not a list
        }
    }
    assert claimed_owners(snapshot["experts"], ["a", "b", "c"], 4) == {0: "a", 2: "c"}
    assert claimed_owners({}, ["a"], 4) == {}
    # a snapshot whose experts section is not a mapping has no claims
    assert MembershipView(FakeState([]), peer_id="a").expert_claims() == {}


async def test_start_up_map_keeps_live_claims_and_assigns_the_rest():
    state = FakeState({"0": ["a"], "1": ["a"], "2": ["c"], "3": ["c"]})
    ownership = ReplicatedOwnership(MembershipView(state, peer_id="b"), num_experts=6, candidates=lambda: ["a", "c"])
    # claims are kept; 4 and 5 go to the least-loaded live member (b, then a tie broken by id)
    assert ownership.current() == {0: "a", 1: "a", 2: "c", 3: "c", 4: "b", 5: "b"}
    await ownership.publish()
    assert state.writes == [["4", "5"]]
    await ownership.publish()
    assert state.writes == [["4", "5"]]  # nothing changed: nothing written


async def test_a_leaver_s_experts_are_reassigned_and_published_at_the_sync():
    state = FakeState({})
    ownership = ReplicatedOwnership(MembershipView(state, peer_id="a"), num_experts=6, candidates=lambda: ["b", "c"])
    assert ownership.current() == {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    owners = await ownership.for_sync("round/3", ["a", "b"])  # c left
    assert owners == {0: "a", 1: "a", 2: "b", 3: "b", 4: "a", 5: "b"}
    assert state.writes == [["0", "1", "4"]]
    ownership.adopt({e: "a" for e in range(6)})
    assert ownership.current() == {e: "a" for e in range(6)}
