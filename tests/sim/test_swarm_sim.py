"""The swarm simulator at its smallest size: it runs the product's cores and reports every figure."""

from __future__ import annotations

from lattica_lab.sim.averaging import consensus_rounds
from lattica_lab.sim.scenario import Scenario, run


def test_a_small_swarm_runs_every_core_and_reports_its_figures():
    result = run(Scenario(size=30, rounds=10, round_s=20.0, churn_per_10min=0.3, observers=2))
    assert result["live_members"] >= 25
    assert result["writers_held"] >= 30  # every member's stream, newcomers included
    assert result["dht_lookups"] > 0
    assert result["dht_lookup_success"] >= 0.9
    assert result["state_sync_bytes_per_peer_per_round"] > 0
    assert result["join_state_s"] > 0.05  # at least one latency


def test_pairwise_gossip_agrees_within_twenty_rounds_at_a_hundred_members():
    rounds = consensus_rounds([f"p{i}" for i in range(100)], dim=16, group_size=2, seed=1)
    assert rounds is not None
    assert rounds <= 20


def test_state_sync_costs_a_peer_a_bounded_share_per_member_at_a_hundred_members():
    """News pushed to a few peers with rare full repairs, not whole vectors with every
    connected peer at every change (that cost ~18 KB per member and second here)."""
    result = run(Scenario(size=100, rounds=10, round_s=10.0, churn_per_10min=0.1, observers=2))
    per_second = result["state_sync_bytes_per_member_per_peer_per_round"] / 10.0
    assert per_second <= 2_000
    assert result["state_sync_full_sessions_share"] < 0.1


def test_a_member_s_round_costs_each_peer_a_few_hundred_bytes_at_a_hundred_members():
    """One change per member and 60-s round (its lease renewed with its progress, lasting beyond
    the round), pushed as 8-byte-tag rumours answered only where the answerer differs, envelopes
    keyed by tag to peers that hold the writer: ~580 bytes per member per peer and round over the
    first 10 rounds (5,290 with renewals every 12.5 s and 47-byte rows answered at every push)."""
    result = run(Scenario(size=100, rounds=10, round_s=60.0, churn_per_10min=0.1, observers=2))
    assert result["heartbeat_interval_s"] > 60.0
    assert result["state_sync_bytes_per_member_per_peer_per_round"] <= 700
