"""Who counts as a live member: leases bounded by the reader's clock, proof of presence, vouches."""

from __future__ import annotations

import pytest

from lattica.crdt.liveness import (
    LeasePolicy,
    Proof,
    VouchPolicy,
    is_live,
    live_members,
    network_origin,
    present,
    verified_writers,
)

NOW = 1_700_000_000_000
POLICY = LeasePolicy(
    heartbeat_interval=1.0, lease=5.0, clock_skew=0.5, max_clock_ahead=10.0, max_heartbeat_interval=1.0,
)


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


def test_renewals_slow_down_with_the_members_and_leases_grow_with_them():
    """Up to 8 members renew every second (5-s leases); past that a member renews about once a
    60-s round from 100 members on, at most every 90 s, its lease outlasting two renewals."""
    policy = LeasePolicy()
    assert policy.interval_for(4) == policy.interval_for(8) == 1.0
    assert policy.lease_for(8) == 5.0
    assert policy.interval_for(16) == pytest.approx(1 + 8 / 1.5)
    assert policy.interval_for(100) > 60.0
    assert policy.lease_for(100) == pytest.approx(5 + 2.5 * 92 / 1.5)
    assert policy.interval_for(1000) == 90.0
    longest = 5 + 2.5 * 89
    assert policy.lease_expiry_ms(NOW, policy.interval_for(1000)) == NOW + longest * 1000
    assert is_live(_record(int(longest * 1000) + 9000), now_ms=NOW, max_ahead_ms=policy.max_ahead_ms)
    assert not is_live(_record(int(longest * 1000) + 11_000), now_ms=NOW, max_ahead_ms=policy.max_ahead_ms)
    with pytest.raises(ValueError, match="max_heartbeat_interval"):
        LeasePolicy(heartbeat_interval=2.0, lease=5.0, max_heartbeat_interval=1.0)
    with pytest.raises(ValueError, match="scaled_lease_intervals"):
        LeasePolicy(scaled_lease_intervals=1.5)


SEASONED = 120.0  # seconds proven without a break: past the default standing


def _proofs(*peers: str, origin: str | None = "10.0.0.0/24", standing_s: float = SEASONED) -> dict[str, Proof]:
    return {peer: Proof(origin, standing_s) for peer in peers}


def test_vouches_count_from_members_with_standing_at_two_network_origins():
    members = {
        "me": _record(),
        "b": _record(peers=["c", "me", "x"]),
        "c": _record(peers=["b", "me", "x", "y"]),
        "m": _record(peers=["p1", "p2", "y"]),  # a member vouching for its throwaway keys
        "p1": _record(10**9),
        "p2": _record(),
        "x": _record(),  # listed by members at two origins: counts
        "y": _record(),  # listed at two origins, but one voucher is new: not yet
    }
    proven = {**_proofs("b", origin="10.0.1.0/24"), **_proofs("c", origin="192.168.7.0/24"),
              **_proofs("m", origin="10.0.2.0/24", standing_s=5.0)}
    verified = verified_writers(members, me="me", proven=proven, now_ms=NOW)
    assert verified == {"me", "b", "c", "m", "x"}
    live = live_members(members, now_ms=NOW, verified=verified, max_ahead_ms=POLICY.max_ahead_ms)
    assert live == ["b", "c", "m", "me", "x"]
    # a minute later m has standing: y is listed at two origins now, m's own keys still at one
    proven["m"] = Proof("10.0.2.0/24", SEASONED)
    assert verified_writers(members, me="me", proven=proven, now_ms=NOW) == {"me", "b", "c", "m", "x", "y"}


def test_many_identities_on_one_network_are_one_origin():
    members = {
        "me": _record(),
        "h": _record(peers=["me"]),
        "m1": _record(peers=["p"]),
        "m2": _record(peers=["p"]),
        "m3": _record(peers=["p"]),
        "p": _record(),
    }
    proven = {**_proofs("h", origin="10.0.9.0/24"), **_proofs("m1", "m2", "m3", origin="203.0.113.0/24")}
    assert "p" not in verified_writers(members, me="me", proven=proven, now_ms=NOW)
    # relayed connections have no origin: they never add one
    proven = {
        **_proofs("h", origin="10.0.9.0/24"), **_proofs("m1", origin="203.0.113.0/24"),
        **_proofs("m2", "m3", origin=None),
    }
    assert "p" not in verified_writers(members, me="me", proven=proven, now_ms=NOW)
    proven["m2"] = Proof("198.51.100.0/24", SEASONED)
    assert "p" in verified_writers(members, me="me", proven=proven, now_ms=NOW)


def test_an_admin_s_word_counts_alone_and_named_admins_alone_admit():
    members = {
        "me": _record(),
        "admin": _record(peers=["x"]),
        "b": _record(peers=["y"]),
        "c": _record(peers=["y"]),
        "x": _record(),
        "y": _record(),
    }
    proven = {**_proofs("admin", origin="10.0.0.0/24", standing_s=0.0),
              **_proofs("b", origin="10.0.1.0/24"), **_proofs("c", origin="10.0.2.0/24")}
    assert verified_writers(members, me="me", proven=proven, admins={"admin"}, now_ms=NOW) >= {"x", "y"}
    named = VouchPolicy(admins_only=True)
    verified = verified_writers(members, me="me", proven=proven, admins={"admin"}, policy=named, now_ms=NOW)
    assert verified == {"me", "admin", "b", "c", "x"}


def test_a_newcomer_takes_its_only_peer_s_word():
    members = {"me": _record(), "boot": _record(peers=["me", "other"]), "other": _record()}
    fresh = _proofs("boot", origin=None, standing_s=0.0)
    assert verified_writers(members, me="me", proven=fresh, newcomer=True, now_ms=NOW) == {"me", "boot", "other"}
    assert verified_writers(members, me="me", proven={}, newcomer=True, now_ms=NOW) == {"me"}
    named = VouchPolicy(admins_only=True)
    assert verified_writers(members, me="me", proven=fresh, newcomer=True, policy=named, now_ms=NOW) == {"me", "boot"}
    # a node that has had other peers: one voucher left (the others' leases lapsed) is no quorum
    assert verified_writers(members, me="me", proven=fresh, now_ms=NOW) == {"me", "boot"}


def test_vouches_of_members_whose_lease_ran_out_do_not_count():
    members = {
        "me": _record(),
        "b": _record(peers=["x"]),
        "c": _record(-60_000, peers=["x"]),  # proven, but its lease ran out a minute ago
        "d": _record(peers=["x"]),
        "x": _record(),
    }
    proven = {**_proofs("b", origin="10.0.1.0/24"), **_proofs("c", origin="10.0.2.0/24")}
    assert verified_writers(members, me="me", proven=proven, now_ms=NOW, clock_skew_ms=500) == {"me", "b", "c"}
    proven["d"] = Proof("10.0.1.0/24", SEASONED)  # d's origin is b's: x is listed at one origin
    assert "x" not in verified_writers(members, me="me", proven=proven, now_ms=NOW)
    proven["d"] = Proof("10.0.3.0/24", SEASONED)
    assert "x" in verified_writers(members, me="me", proven=proven, now_ms=NOW)


@pytest.mark.parametrize(
    ("host", "relayed", "origin"),
    [
        ("203.0.113.77", False, "203.0.113.0/24"),
        ("2001:db8:1234:5678::1", False, "2001:db8:1234::/48"),
        ("::ffff:198.51.100.9", False, "198.51.100.0/24"),
        ("203.0.113.77", True, None),
        (None, False, None),
        ("not an address", False, None),
    ],
)
def test_network_origins(host, relayed, origin):
    assert network_origin(host, relayed=relayed) == origin


def test_vouch_policy_is_validated():
    with pytest.raises(ValueError, match="quorum"):
        VouchPolicy(quorum=0)
    with pytest.raises(ValueError, match="min_standing_s"):
        VouchPolicy(min_standing_s=-1.0)


def test_the_swarm_size_that_paces_renewals_counts_expired_leases_but_not_leavers():
    """A lagging view (a loaded host) sees leases expire: counting only live ones would renew
    faster, lag more and see fewer still."""
    members = {"a": _record(3000), "b": _record(-60_000), "c": _record(-60_000, left=True)}
    assert present(members) == 2
