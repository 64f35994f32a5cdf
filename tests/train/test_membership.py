"""RecentTrainers: a cut-off peer still knows that others train; killed, finished, failed or
departed ones do not count. MembershipView: who trains, as the members' (untrusted) roles say."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lattica.train.swarm.membership import (
    FAILED_ROLE,
    JOINING_ROLE,
    TRAINER_ROLE,
    MembershipView,
    RecentTrainers,
    UnservableClaims,
)
from lattica.train.swarm.outer_transfer import agreed_round


def _trainers(*peers: str) -> dict[str, dict[str, object]]:
    return {p: {"role": "trainer"} for p in peers}


def test_connected_trainers_whose_leases_ran_out_are_remembered_for_a_while() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    members = _trainers("me", "a", "b")
    recent.observe(members, ["me", "a", "b"], {"a", "b"}, now=0.0)
    assert recent.others() == {"a", "b"}
    # our link was cut: every other lease ran out, but no connection broke
    recent.observe(members, ["me"], {"a", "b"}, now=10.0)
    assert recent.others() == {"a", "b"}
    recent.observe(members, ["me"], {"a", "b"}, now=61.0)
    assert recent.others() == set()


def test_killed_trainers_are_forgotten_once_their_lease_ran_out() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    members = _trainers("me", "a", "b")
    recent.observe(members, ["me", "a", "b"], {"a", "b"}, now=0.0)
    recent.observe(members, ["me", "a", "b"], {"b"}, now=1.0)  # a killed: connection gone, lease not yet
    assert recent.others() == {"a", "b"}
    recent.observe(members, ["me", "b"], {"b"}, now=6.0)
    assert recent.others() == {"b"}


def test_a_peer_alone_from_the_start_has_no_others() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me"), ["me"], set(), now=0.0)
    assert recent.others() == set()


def test_finished_members_are_forgotten_at_once() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me", "a"), ["me", "a"], {"a"}, now=0.0)
    recent.observe({**_trainers("me"), "a": {"role": "done"}}, ["me", "a"], {"a"}, now=1.0)
    assert recent.others() == set()


def test_a_member_whose_training_failed_is_forgotten_at_once() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me", "a"), ["me", "a"], {"a"}, now=0.0)
    recent.observe({**_trainers("me"), "a": {"role": "failed"}}, ["me", "a"], {"a"}, now=1.0)
    assert recent.others() == set()


@pytest.mark.parametrize("role", ["x" * 512, "", None, 7, ["trainer"]])
def test_a_role_this_version_does_not_know_is_no_trainer(role: object) -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me", "a"), ["me", "a"], {"a"}, now=0.0)
    recent.observe({**_trainers("me"), "a": {"role": role}, "b": {"role": role}}, ["me", "a", "b"], {"a", "b"}, now=1.0)
    assert recent.others() == set()


def _view(members: dict[str, Any], live: list[str]) -> MembershipView:
    state = SimpleNamespace(snapshot=lambda: {"members": members}, live_members=lambda: list(live))
    return MembershipView(state, peer_id="me")  # type: ignore[arg-type]


def test_a_failed_member_is_neither_a_trainer_nor_still_loading() -> None:
    members = {
        "me": {"role": "trainer"}, "a": {"role": "failed"}, "b": {"role": "joining"},
        "c": {"role": "no such role"}, "d": {"role": None}, "gone": {"role": "failed"},
    }
    view = _view(members, live=["me", "a", "b", "c", "d"])
    assert view.trainers() == ["me"]
    assert view.live_with_role(JOINING_ROLE, TRAINER_ROLE) == ["me", "b"]  # a start of a run waits for these
    assert view.failed() == ["a"]
    assert view.live_with_role(FAILED_ROLE) == ["a"]


def test_a_member_catching_up_still_counts_until_the_memory_runs_out() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me", "a"), ["me", "a"], {"a"}, now=0.0)
    joining = {**_trainers("me"), "a": {"role": "joining"}}  # fetching a state to catch up
    recent.observe(joining, ["me", "a"], {"a"}, now=30.0)
    assert recent.others() == {"a"}
    recent.observe(joining, ["me", "a"], {"a"}, now=61.0)
    assert recent.others() == set()


def test_a_peer_that_never_trained_does_not_count() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe({**_trainers("me"), "a": {"role": "joining"}}, ["me", "a"], {"a"}, now=0.0)
    assert recent.others() == set()


def test_a_member_that_left_is_forgotten_at_once() -> None:
    recent = RecentTrainers(peer_id="me", memory_s=60)
    recent.observe(_trainers("me", "a"), ["me", "a"], {"a"}, now=0.0)
    recent.observe({**_trainers("me"), "a": {"role": "trainer", "left": True}}, ["me"], {"a"}, now=1.0)
    assert recent.others() == set()


def test_memory_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="memory_s"):
        RecentTrainers(peer_id="me", memory_s=-1)


def test_an_unservable_claim_is_distrusted_until_served_and_retried_after_a_doubling_back_off() -> None:
    claims = UnservableClaims(base_s=5.0, max_s=12.0)
    fake = (999, "f" * 64)
    progress = {
        "liar": {"round": 999, "weights_hash": "f" * 64},
        "b": {"round": 3, "weights_hash": "h3"},
        "junk": "not a record",
    }
    assert claims.trusted_progress(progress, now=0.0) == progress
    assert agreed_round(progress, ["b", "liar", "me"], "me") == (999, "f" * 64, ["liar"])  # what it replaces
    assert claims.failed(fake, now=0.0) == 5.0
    assert set(claims.trusted_progress(progress, now=1.0)) == {"b", "junk"}
    assert agreed_round(claims.trusted_progress(progress, now=1.0), ["b", "liar", "me"], "me") == (3, "h3", ["b"])
    assert claims.trusted_progress(progress, now=5.5) == progress  # offered again after the back-off
    assert claims.distrusted(fake)  # but not trusted for rounds until a fetch succeeds
    assert claims.failed(fake, now=5.5) == 10.0
    assert claims.failed(fake, now=16.0) == 12.0  # capped
    assert claims.backing_off(fake, now=27.0)
    assert not claims.distrusted((3, "h3"))
    claims.served(fake)
    assert not claims.distrusted(fake)
    assert claims.trusted_progress(progress, now=28.0) == progress
    with pytest.raises(ValueError, match="base_s"):
        UnservableClaims(base_s=0)


def test_the_reachability_members_advertise_is_read_from_their_records() -> None:
    members = {"a": {"reachability": "private"}, "b": {"reachability": "public"}, "c": {"reachability": None}, "d": {}}
    assert _view(members, live=["a"]).advertised_reachability() == {"a": "private", "b": "public"}
