"""Partners a replica refused are left out of its draws: for how long, and from what."""

from __future__ import annotations

import pytest

from lattica.coordination.avoidance import AvoidanceConfig, PartnerAvoidance


def test_a_refused_partner_is_left_out_for_the_next_steps_only() -> None:
    avoidance = PartnerAvoidance(AvoidanceConfig(avoid_steps=3))
    assert avoidance.refused("b", step=10) == 14
    assert [avoidance.avoids("b", step=s) for s in (10, 13, 14)] == [True, True, False]
    assert avoidance.drawable(["a", "b", "c"], step=12) == ["a", "c"]
    assert avoidance.drawable(["a", "b", "c"], step=14) == ["a", "b", "c"]
    assert avoidance.avoided(step=12) == ["b"]
    assert avoidance.avoided(step=14) == []


def test_each_further_refusal_doubles_the_time_up_to_the_cap() -> None:
    avoidance = PartnerAvoidance(AvoidanceConfig(avoid_steps=2, max_avoid_steps=8))
    spans = []
    for offence in range(5):
        step = 100 * offence
        spans.append(avoidance.refused("b", step=step) - step - 1)
    assert spans == [2, 4, 8, 8, 8]


def test_a_refusal_never_shortens_an_avoidance() -> None:
    avoidance = PartnerAvoidance(AvoidanceConfig(avoid_steps=8))
    until = avoidance.refused("b", step=5)
    assert avoidance.refused("b", step=0) >= until  # reported late, for an earlier step


def test_the_config_is_validated() -> None:
    with pytest.raises(ValueError, match="avoid_steps"):
        AvoidanceConfig(avoid_steps=0)
    with pytest.raises(ValueError, match="avoid_steps"):
        AvoidanceConfig(avoid_steps=16, max_avoid_steps=8)
