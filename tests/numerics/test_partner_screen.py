"""The partner screen: what a replica refuses of its group partners, judged against its own."""

from __future__ import annotations

import math

import pytest
import torch

from lattica.numerics.partner_screen import PartnerScreen, refusal, segment_norm
from lattica.numerics.screen import PLAIN_MEAN, Rejection, accepted_members, reduce_parts


def _update(*values: float) -> dict[str, list[torch.Tensor]]:
    return {"delta": [torch.tensor(values, dtype=torch.float32)]}


def test_segment_norm_over_several_tensors_and_its_non_finite_cases() -> None:
    assert segment_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == pytest.approx(5.0)
    assert segment_norm([]) == 0.0
    assert math.isnan(segment_norm([torch.tensor([1.0, float("nan")])]))
    assert math.isnan(segment_norm([torch.tensor([float("-inf")])]))
    assert segment_norm([torch.tensor([1e20, 1e20])]) == math.inf  # finite values, fp32 norm overflows
    assert segment_norm([torch.tensor([1.0], dtype=torch.float16)]) == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_partner_is_refused_even_in_a_group_of_two(bad: float) -> None:
    screen = PartnerScreen()
    verdict = screen.screen(_update(1.0, 2.0), {"b": _update(1.0, bad)})
    assert verdict.accepted == ()
    assert verdict.rejected == (Rejection("b", "non-finite values in delta"),)
    assert screen.refused == {"b": 1}


def test_non_finite_values_are_refused_with_the_norm_screen_off() -> None:
    verdict = PartnerScreen(None).screen(_update(1.0), {"b": _update(float("nan")), "c": _update(1e9)})
    assert verdict.accepted == ("c",)
    assert [r.peer for r in verdict.rejected] == ["b"]


def test_a_pair_refuses_a_partner_far_above_its_own_norm_and_keeps_one_within() -> None:
    screen = PartnerScreen(10.0)
    verdict = screen.screen(_update(3.0, 4.0), {"b": _update(30.0, 40.0), "c": _update(30.0, 40.1)})
    assert verdict.accepted == ("b",)  # exactly 10x is still accepted
    assert verdict.rejected[0].peer == "c"
    assert "norm of delta 50.1 > 10 x 5" in verdict.rejected[0].reason


def test_a_finite_1e30_partner_is_refused() -> None:
    verdict = PartnerScreen().screen(_update(1.0), {"b": _update(1e30)})
    assert [r.peer for r in verdict.rejected] == ["b"]  # its fp32 norm overflows


def test_each_segment_is_judged_on_its_own() -> None:
    own = {"phi": [torch.full((4,), 100.0)], "delta": [torch.full((4,), 0.01)]}
    partner = {"phi": [torch.full((4,), 100.0)], "delta": [torch.full((4,), 1.0)]}  # Δ 100x ours
    verdict = PartnerScreen().screen(own, {"b": partner})
    assert verdict.accepted == ()
    assert "norm of delta" in verdict.rejected[0].reason


def test_a_zero_reference_gives_no_scale() -> None:
    screen = PartnerScreen()
    assert screen.screen(_update(0.0, 0.0), {"b": _update(1e6)}).accepted == ("b",)
    # a segment this replica does not send has no reference either: only non-finite values count
    assert screen.screen({}, {"b": _update(1e6)}).accepted == ("b",)


def test_the_history_keeps_one_small_own_update_from_refusing_honest_partners() -> None:
    screen = PartnerScreen(10.0, history=4)
    for _ in range(3):
        assert screen.screen(_update(1.0), {"b": _update(2.0)}).accepted == ("b",)
    # this round our own update is tiny (a short phase): the median of our recent norms decides
    assert screen.screen(_update(0.01), {"b": _update(2.0)}).accepted == ("b",)
    assert screen.screen(_update(0.01), {"b": _update(11.0)}).accepted == ()


def test_partners_cannot_move_the_reference_even_when_they_collude() -> None:
    screen = PartnerScreen(10.0)
    for _ in range(20):  # two partners always sending 9x our norm: accepted, but never our scale
        screen.screen(_update(1.0), {"b": _update(9.0), "c": _update(9.0)})
    verdict = screen.screen(_update(1.0), {"b": _update(81.0), "c": _update(81.0)})
    assert verdict.accepted == ()


def test_the_history_forgets_beyond_its_window() -> None:
    screen = PartnerScreen(10.0, history=2)
    for _ in range(2):
        screen.screen(_update(100.0), {})
    assert screen.screen(_update(1.0), {"b": _update(500.0)}).accepted == ("b",)  # median of 100, 100
    screen.screen(_update(1.0), {})
    screen.screen(_update(1.0), {})  # the window now holds 1, 1
    assert screen.screen(_update(1.0), {"b": _update(500.0)}).accepted == ()


def test_verdicts_do_not_depend_on_the_order_partners_answered() -> None:
    received = {"b": _update(2.0), "c": _update(float("nan")), "d": _update(50.0), "e": _update(3.0)}
    forward = PartnerScreen().screen(_update(1.0), received)
    backward = PartnerScreen().screen(_update(1.0), dict(reversed(received.items())))
    assert set(forward.accepted) == set(backward.accepted) == {"b", "e"}
    assert {r.peer for r in forward.rejected} == {r.peer for r in backward.rejected} == {"c", "d"}


def test_a_non_finite_own_contribution_is_judged_by_the_history_alone() -> None:
    screen = PartnerScreen(10.0)
    screen.screen(_update(1.0), {})
    verdict = screen.screen(_update(float("nan")), {"b": _update(2.0), "c": _update(20.0)})
    assert verdict.accepted == ("b",)


def test_refusals_are_counted_and_reported_once_each() -> None:
    reported: list[Rejection] = []
    screen = PartnerScreen(on_refused=reported.append)
    screen.screen(_update(1.0), {"b": _update(float("nan")), "c": _update(1.0)})
    screen.screen(_update(1.0), {"b": _update(100.0)})
    screen.refuse(Rejection("d", "malformed payload"))
    assert [r.peer for r in reported] == ["b", "b", "d"]
    assert screen.refused == {"b": 2, "d": 1}


def test_refusal_against_explicit_references() -> None:
    assert refusal("b", {"x": 1.0}, {"x": 0.05}, 10.0) == Rejection("b", "norm of x 1 > 10 x 0.05")
    assert refusal("b", {"x": 1.0}, {"x": 0.05}, None) is None
    assert refusal("b", {"x": math.nan}, {}, None) == Rejection("b", "non-finite values in x")
    assert refusal("b", {"x": math.inf}, {}, None) == Rejection("b", "norm of x overflows")


def test_the_screen_is_validated() -> None:
    for ratio in (0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_norm_ratio"):
            PartnerScreen(ratio)
    with pytest.raises(ValueError, match="history"):
        PartnerScreen(history=0)


def test_accepted_members_reaches_the_all_reduce_owner_s_verdicts() -> None:
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(64, generator=gen) for _ in range(4)]
    parts[1] = parts[1] * 1000
    parts[2] = parts[2].clone()
    parts[2][5] = float("nan")
    peers = ["a", "b", "c", "d"]
    accepted, rejected = accepted_members(parts, peers)
    assert accepted == [0, 3]
    _, reduced_rejected = reduce_parts(parts, peers)
    assert rejected == reduced_rejected
    assert accepted_members(parts[:2], peers[:2]) == ([0, 1], [])  # two: no majority by norm
    assert accepted_members(parts, peers, PLAIN_MEAN)[0] == [0, 1, 3]
