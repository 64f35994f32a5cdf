"""Who counts as a live member: leases bounded by the reader's clock, proof of presence, vouches."""

from __future__ import annotations

import pytest

from lattica.crdt.liveness import LeasePolicy, is_live, live_members, verified_writers

NOW = 1_700_000_000_000
POLICY = LeasePolicy(heartbeat_interval=1.0, lease=5.0, clock_skew=0.5, max_clock_ahead=10.0)


def _record(expires_in_ms: int = 3000, *, peers: list[str] | None = None, left: bool = False) -> dict:
    return {"lease_expires_ms": NOW + expires_in_ms, "left": left, "peers": peers or []}


def test_a_lease_far_beyond_the_reader_s_clock_is_no_lease():
    far = {"lease_expires_ms": 2_085_000_000_000, "left": False}  # 2036
    assert is_live(far, now_ms=NOW)  # the unbounded reading, kept for callers that pass no bound
    assert not is_live(far, now_ms=NOW, max_ahead_ms=POLICY.max_ahead_ms)
    # an honest writer whose clock runs a few seconds ahead still counts
    assert is_live(_record(5000 + 9000), now_ms=NOW, max_ahead_ms=POLICY.max_ahead_ms)
    assert not is_live(_record(5000 + 11_000), now_ms=NOW, max_ahead_ms=POLICY.max_ahead_ms)
    with pytest.raises(ValueError, match="max_clock_ahead"):
        LeasePolicy(max_clock_ahead=-1)


def test_only_proven_or_vouched_writers_are_live():
    members = {
        "me": _record(),
        "b": _record(peers=["c", "me", "x"]),
        "c": _record(peers=["b", "me", "x"]),
        "m": _record(peers=["p1", "p2", "x"]),  # a member vouching for its throwaway keys
        "p1": _record(10**9),
        "p2": _record(),
        "x": _record(),  # vouched for by two members we verified: counts
        "y": _record(),
    }
    verified = verified_writers(members, me="me", proven={"b", "c", "m"}, now_ms=NOW)
    assert verified == {"me", "b", "c", "m", "x"}
    live = live_members(members, now_ms=NOW, verified=verified, max_ahead_ms=POLICY.max_ahead_ms)
    assert live == ["b", "c", "m", "me", "x"]


def test_a_newcomer_takes_its_only_peer_s_word():
    members = {"me": _record(), "boot": _record(peers=["me", "other"]), "other": _record()}
    assert verified_writers(members, me="me", proven={"boot"}, now_ms=NOW) == {"me", "boot", "other"}
    assert verified_writers(members, me="me", proven=set(), now_ms=NOW) == {"me"}


def test_vouches_of_members_whose_lease_ran_out_do_not_count():
    members = {
        "me": _record(),
        "b": _record(peers=["x"]),
        "c": _record(-60_000, peers=["x"]),  # proven, but its lease ran out a minute ago
        "x": _record(),
    }
    assert verified_writers(members, me="me", proven={"b", "c"}, now_ms=NOW, clock_skew_ms=500) == {"me", "b", "c", "x"}
    members["d"] = _record(peers=[])
    assert "x" not in verified_writers(members, me="me", proven={"b", "c", "d"}, now_ms=NOW)
