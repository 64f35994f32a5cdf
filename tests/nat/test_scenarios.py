"""One test per NAT scenario, each in its own namespace lab (built and torn down inside)."""

import pytest

from lattica_lab import nat_scenarios as scenarios

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60), pytest.mark.usefixtures("netlab_available")]


def test_public_public_direct():
    r = scenarios.public_public()
    assert r.connected
    assert r.path == "direct"
    assert r.details == {"reachability_a": "public", "transfer": True}


def test_nat_public_both_directions():
    r = scenarios.nat_public()
    assert r.details["nat_to_public"] == "direct"
    assert r.details["reachability_priv"] == "private"
    assert r.details["reachability_pub"] == "public"
    # the public side reaches the NAT'd node back: relayed first, then reversed to direct
    assert r.connected, r
    assert r.path == "hole-punched", r
    assert r.details["transfer"] is True


def test_nat_nat_relayed_then_hole_punched():
    r = scenarios.nat_nat(symmetric=False)
    assert r.connected, r
    assert r.details["first_path"] == "relayed", r
    assert r.path == "hole-punched", r
    assert r.details["hole_punch"] == "succeeded", r
    assert r.details["transfer_ok"] is True
    # the transfer right after the punch runs over the direct connection, and the path book
    # (read when the transfer ends) says so too
    assert r.details["transfer_via"] == "direct", r
    assert r.details["transfer_path"] == "hole-punched", r


def test_symmetric_nat_stays_relayed_and_moves_bytes():
    r = scenarios.nat_nat(symmetric=True)
    assert r.connected, r
    assert r.details["first_path"] == "relayed", r
    assert r.details["hole_punch"] == "failed"
    assert r.path == "relayed"
    assert r.details["transfer_ok"] is True
    assert r.details["transfer_path"] == "relayed"
    assert r.details["transfer_via"] == "relayed"


def test_relay_killed_peers_rereserve_and_reconnect():
    r = scenarios.relay_failover()
    assert r.connected, r
    assert r.path == "relayed", r
    assert r.details["transfer"] is True
    assert r.details["rereserve_s"] < 10
