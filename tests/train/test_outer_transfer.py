"""Outer-state transfer: the agreed round, and what holders serve fetched back, verified."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio
import trio.lowlevel

from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.train.engine.outer_state import outer_state_hash, unflatten_outer_state
from lattica.train.swarm.join import fetch_outer_state
from lattica.train.swarm.outer_transfer import (
    ServedRounds,
    agreed_round,
    fetch_of_round,
    repair_target,
    serve_outer_state,
)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "round": 4,
        "step": 20,
        "completed_rounds": 3,
        "params": {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
        "momentum": {"w": torch.randn(3, 2, generator=g)},
    }


def test_agreed_round_is_the_state_with_the_most_live_holders() -> None:
    progress = {
        "a": {"round": 3, "weights_hash": "h3"},
        "b": {"round": 3, "weights_hash": "h3"},
        "c": {"round": 3, "weights_hash": "x3"},
        "d": {"round": 2, "weights_hash": "h2"},
        "gone": {"round": 9, "weights_hash": "h9"},  # not live
        "me": {"round": 7, "weights_hash": "m7"},  # our own record does not count
    }
    assert agreed_round(progress, ["a", "b", "c", "d", "me"], "me") == (3, "h3", ["a", "b"])


def test_agreed_round_skips_round_zero_and_malformed_records() -> None:
    progress = {
        "a": {"round": 0, "weights_hash": "h0"},
        "b": {"round": "3", "weights_hash": "h3"},
        "c": {"round": 3, "weights_hash": ""},
        "d": None,
        "e": {"round": True, "weights_hash": "t"},
    }
    assert agreed_round(progress, ["a", "b", "c", "d", "e"], "me") is None
    assert agreed_round({}, [], "me") is None


def test_agreed_round_breaks_ties_by_the_smallest_hash() -> None:
    progress = {"a": {"round": 2, "weights_hash": "bb"}, "b": {"round": 2, "weights_hash": "aa"}}
    assert agreed_round(progress, ["a", "b"], "me") == (2, "aa", ["b"])
    assert agreed_round(progress, ["b", "a"], "me") == (2, "aa", ["b"])


LIVE = ["a", "b", "c", "me"]


def test_repair_target_when_behind_the_others() -> None:
    progress = {p: {"round": 5, "weights_hash": "h5"} for p in ("a", "b", "c")}
    assert repair_target(progress, LIVE, "me", (4, "h4")) == (5, "h5", ["a", "b", "c"])
    assert repair_target(progress, LIVE, "me", (0, None)) == (5, "h5", ["a", "b", "c"])


def test_repair_target_none_when_in_agreement_or_ahead() -> None:
    progress = {p: {"round": 5, "weights_hash": "h5"} for p in ("a", "b", "c")}
    assert repair_target(progress, LIVE, "me", (5, "h5")) is None
    assert repair_target(progress, LIVE, "me", (6, "h6")) is None
    assert repair_target({}, LIVE, "me", (6, "h6")) is None


def test_repair_target_minority_adopts_the_majority_and_ties_are_decided_alike() -> None:
    split = {"a": {"round": 5, "weights_hash": "zz"}, "b": {"round": 5, "weights_hash": "zz"},
             "c": {"round": 5, "weights_hash": "aa"}}
    # me + c hold "aa" (2 votes), a + b hold "zz" (2 votes): the tie goes to "aa" on every peer
    assert repair_target(split, LIVE, "me", (5, "aa")) is None
    progress = {**split, "me": {"round": 5, "weights_hash": "aa"}}
    assert repair_target(progress, LIVE, "a", (5, "zz")) == (5, "aa", ["c", "me"])
    # a clear majority wins whatever its hash
    majority = {p: {"round": 5, "weights_hash": "zz"} for p in ("a", "b", "c")}
    assert repair_target(majority, LIVE, "me", (5, "aa")) == (5, "zz", ["a", "b", "c"])


class _FakeStore:
    """In-memory holders: ``tensors[peer][name]``; a peer in ``down`` fails every fetch."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.down: set[str] = set()
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def holder(self, peer: str):
        store = self

        class _Serve:
            def serve(self, name: str, tensor: torch.Tensor) -> None:
                store.tensors.setdefault(peer, {})[name] = tensor

        return _Serve()

    async def fetch(self, peer: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        await trio.lowlevel.checkpoint()
        self.asked.append((peer, tuple(names)))
        if peer in self.down:
            raise PeerUnavailableError(f"{peer} is gone")
        return {n: self.tensors[peer][n] for n in names}


def _served(peers: Sequence[str], state: dict) -> _FakeStore:
    store = _FakeStore()
    for peer in peers:
        serve_outer_state(store.holder(peer), state)
    return store


async def test_served_state_is_fetched_from_several_holders_and_verified() -> None:
    state = _state()
    store = _served(["a", "b"], state)
    flat = await fetch_outer_state(["a", "b"], store.fetch, expected_hash=outer_state_hash(state))
    assert {peer for peer, _ in store.asked} == {"a", "b"}
    got = unflatten_outer_state(flat)
    assert (got["round"], got["step"]) == (4, 20)
    assert torch.equal(got["params"]["w"], state["params"]["w"])
    assert torch.equal(got["momentum"]["w"], state["momentum"]["w"])


async def test_a_failed_holders_share_comes_from_another() -> None:
    state = _state()
    store = _served(["a", "b"], state)
    store.down.add("a")
    flat = await fetch_outer_state(["a", "b"], store.fetch, expected_hash=outer_state_hash(state))
    assert torch.equal(flat["params/b"], state["params"]["b"])


async def test_a_state_that_does_not_match_the_published_hash_is_refused() -> None:
    state, lie = _state(0), _state(1)
    store = _served(["a"], lie)
    with pytest.raises(RemoteProtocolError):
        await fetch_outer_state(["a"], store.fetch, expected_hash=outer_state_hash(state))


async def test_no_holders_is_peer_unavailable() -> None:
    with pytest.raises(PeerUnavailableError):
        await fetch_outer_state([], _FakeStore().fetch, expected_hash="0" * 64)


def test_agreed_round_is_the_state_most_live_peers_hold_not_the_newest() -> None:
    # "a" ran rounds on its own while cut off: it is ahead, but the run is what b, c, d hold
    progress = {
        "a": {"round": 9, "weights_hash": "solo"},
        "b": {"round": 6, "weights_hash": "h6"},
        "c": {"round": 6, "weights_hash": "h6"},
        "d": {"round": 6, "weights_hash": "h6"},
    }
    assert agreed_round(progress, ["a", "b", "c", "d"], "me") == (6, "h6", ["b", "c", "d"])
    # equal holders: the newest round wins
    tie = {"a": {"round": 7, "weights_hash": "h7"}, "b": {"round": 6, "weights_hash": "h6"}}
    assert agreed_round(tie, ["a", "b"], "me") == (7, "h7", ["a"])


def test_a_replica_cut_off_and_ahead_adopts_the_majority() -> None:
    progress = {p: {"round": 6, "weights_hash": "h6"} for p in ("a", "b", "c")}
    # our own rounds 6..9 ran apart from the others: our hash at round 6 is not theirs
    history = {5: "h5", 6: "solo6", 7: "solo7", 8: "solo8", 9: "solo9"}
    assert repair_target(progress, LIVE, "me", (9, "solo9"), history) == (6, "h6", ["a", "b", "c"])


def test_a_replica_ahead_on_the_same_line_keeps_its_state() -> None:
    # the others synced round 7 with us but have not published it yet
    progress = {p: {"round": 6, "weights_hash": "h6"} for p in ("a", "b", "c")}
    assert repair_target(progress, LIVE, "me", (7, "h7"), {6: "h6", 7: "h7"}) is None
    # and with no history of round 6 (e.g. after a restart) we cannot tell: keep it too
    assert repair_target(progress, LIVE, "me", (7, "h7"), {7: "h7"}) is None


def test_the_majority_does_not_follow_a_replica_that_ran_ahead_alone() -> None:
    progress = {
        "a": {"round": 6, "weights_hash": "h6"},
        "b": {"round": 6, "weights_hash": "h6"},
        "c": {"round": 9, "weights_hash": "solo9"},
    }
    assert repair_target(progress, LIVE, "me", (6, "h6"), {6: "h6"}) is None


class _Shelf:
    """A TensorStore that records what is on offer."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def serve(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def unserve(self, name: str) -> None:
        self.tensors.pop(name, None)

    async def fetch(self, peer: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        await trio.lowlevel.checkpoint()
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise PeerUnavailableError(f"{peer} does not serve {missing}")
        return {n: self.tensors[n] for n in names}


async def test_a_holder_that_moved_on_still_serves_the_round_a_joiner_saw() -> None:
    shelf = _Shelf()
    served = ServedRounds(shelf, keep=2)
    older, newer, newest = _state(0), _state(1), _state(2)
    served.publish(4, older)
    served.publish(5, newer)
    # the joiner read "round 5, hash of newer"; the holder completes round 6 meanwhile
    served.publish(6, newest)
    assert served.rounds == [5, 6]
    flat = await fetch_outer_state(["h"], fetch_of_round(shelf.fetch, 5), expected_hash=outer_state_hash(newer))
    assert torch.equal(unflatten_outer_state(flat)["params"]["w"], newer["params"]["w"])
    assert not any(name.startswith("outer/4/") for name in shelf.tensors)  # only `keep` rounds held
    with pytest.raises(PeerUnavailableError):
        await fetch_outer_state(["h"], fetch_of_round(shelf.fetch, 4), expected_hash=outer_state_hash(older))


def test_republishing_a_round_replaces_its_tensors() -> None:
    shelf = _Shelf()
    served = ServedRounds(shelf)
    served.publish(3, _state(0))
    served.publish(3, _state(1))
    assert torch.equal(shelf.tensors["outer/3/params/w"], _state(1)["params"]["w"])
    with pytest.raises(ValueError, match="keep"):
        ServedRounds(shelf, keep=0)
