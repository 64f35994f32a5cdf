"""The owner's mean summed while the contributions arrive: the same bits and the same verdicts
as ``reduce_parts`` on the whole contributions, whatever order the frames come in."""

from __future__ import annotations

import random

import pytest
import torch

from lattica.numerics import screen
from lattica.numerics.screen import DEFAULT_SCREEN, PLAIN_MEAN, reduce_parts
from lattica.numerics.streaming_mean import StreamingMean

PEERS = ["a", "b", "c", "d"]
NUMEL = 3 * screen.BLOCK + 1000  # several blocks and a partial one


def _contributions(numel: int = NUMEL) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(numel, generator=gen) for _ in PEERS]


def _stream(contributions: list[torch.Tensor], *, own: int = 0, frame: int = 40_000, seed: int = 1,
            in_place: bool = False) -> tuple[torch.Tensor, StreamingMean]:
    """Feed the other members' contributions frame by frame, in a shuffled interleaving, as
    the data plane does; ``own`` is whole from the start (in place: it is ``out`` itself)."""
    numel = contributions[0].numel()
    slots = [torch.full((numel,), float("nan")) for _ in contributions]
    out = contributions[own].clone() if in_place else torch.empty(numel)
    if not in_place:
        slots[own] = contributions[own]
    mean = StreamingMean(slots, out, whole=[own], keep_index=own if in_place else None)
    progress = {j: 0 for j in range(len(contributions)) if j != own}
    summed_before_the_last_frame = 0
    rng = random.Random(seed)
    while progress:
        j = rng.choice(sorted(progress))  # the senders' frames interleave at random
        start = progress[j]
        stop = min(start + rng.randrange(1, 2 * frame), numel)
        slots[j][start:stop] = contributions[j][start:stop]
        if len(progress) == 1 and stop == numel:
            summed_before_the_last_frame = mean.summed
        mean.arrived(j, stop * 4)
        progress[j] = stop
        if stop == numel:
            del progress[j]
    assert summed_before_the_last_frame > 0  # blocks were summed while frames still arrived
    return out, mean


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_streamed_mean_is_the_plain_mean_bit_for_bit(seed: int, in_place: bool) -> None:
    contributions = _contributions()
    out, mean = _stream(contributions, own=seed % 4, seed=seed, in_place=in_place)
    assert mean.finish(DEFAULT_SCREEN, PEERS) == []
    expected, _ = reduce_parts(contributions, PEERS, PLAIN_MEAN)
    assert torch.equal(out, expected)
    assert torch.equal(out, (contributions[0] + contributions[1] + contributions[2] + contributions[3]) / 4)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_contributor_is_excluded(bad: float, in_place: bool) -> None:
    contributions = _contributions()
    contributions[2][screen.BLOCK + 5] = bad  # in a block summed while the others still arrive
    out, mean = _stream(contributions, own=1, in_place=in_place)
    rejected = mean.finish(DEFAULT_SCREEN, PEERS)
    assert [r.peer for r in rejected] == ["c"]
    honest = [contributions[i] for i in (0, 1, 3)]
    expected, _ = reduce_parts(honest, ["a", "b", "d"], PLAIN_MEAN)
    assert torch.equal(out, expected)  # the own contribution survived the in-place sum


@pytest.mark.parametrize("in_place", [False, True])
def test_a_norm_outlier_is_excluded_and_the_plain_mean_screen_keeps_it(in_place: bool) -> None:
    contributions = _contributions()
    contributions[3] *= 1000.0  # finite, 1000x the others' norm
    out, mean = _stream(contributions, own=0, in_place=in_place)
    assert [r.peer for r in mean.finish(DEFAULT_SCREEN, PEERS)] == ["d"]
    expected, _ = reduce_parts(contributions[:3], PEERS[:3], PLAIN_MEAN)
    assert torch.equal(out, expected)

    out, mean = _stream(contributions, own=0, in_place=in_place)
    assert mean.finish(PLAIN_MEAN, PEERS) == []
    assert torch.equal(out, reduce_parts(contributions, PEERS, PLAIN_MEAN)[0])


def test_values_whose_squares_overflow_take_the_exact_path() -> None:
    # 1e20 squared is beyond float32: the sums of squares cannot vouch for these contributions,
    # so the exact path judges them (all finite, no outlier) and keeps every one
    contributions = _contributions()
    for c in contributions:
        c[10] = 1e20
    out, mean = _stream(contributions, own=2)
    assert mean.finish(DEFAULT_SCREEN, PEERS) == []
    assert torch.equal(out, reduce_parts(contributions, PEERS, DEFAULT_SCREEN)[0])


def test_only_norm_screens_stream() -> None:
    assert screen.only_screens_norms(DEFAULT_SCREEN)
    assert screen.only_screens_norms(PLAIN_MEAN)
    assert not screen.only_screens_norms(screen.ContributionScreen(trim=1))
    assert not screen.only_screens_norms(screen.ContributionScreen(median=True))
    assert not screen.only_screens_norms(screen.ContributionScreen(clip_ratio=2.0))


def test_a_contribution_that_came_before_its_slot_was_offered_is_summed_from_where_it_landed() -> None:
    # a fast member's part can arrive before this member posted its slots: it lands in a
    # buffer of its own, and the slot keeps whatever the scratch pool held before
    contributions = _contributions()
    slots = [torch.full((NUMEL,), 123.0) for _ in contributions]  # stale scratch
    slots[0] = contributions[0]
    out = torch.empty(NUMEL)
    mean = StreamingMean(slots, out, whole=[0])
    mean.landed(2, contributions[2].clone())  # early, elsewhere
    for j in (1, 3):
        slots[j].copy_(contributions[j])
        mean.landed(j, slots[j])
    assert mean.finish(DEFAULT_SCREEN, PEERS) == []
    assert torch.equal(out, reduce_parts(contributions, PEERS, PLAIN_MEAN)[0])


def test_the_verdict_waits_for_every_contribution() -> None:
    contributions = _contributions()
    mean = StreamingMean([contributions[0], torch.empty(NUMEL)], torch.empty(NUMEL), whole=[0])
    with pytest.raises(ValueError, match="not landed"):
        mean.finish(DEFAULT_SCREEN, PEERS[:2])


def test_a_second_copy_after_part_of_a_first_reached_the_slot_is_refused() -> None:
    contributions = _contributions()
    slot = torch.zeros(NUMEL)
    mean = StreamingMean([contributions[0], slot], torch.empty(NUMEL), whole=[0])
    slot[: screen.BLOCK] = contributions[1][: screen.BLOCK]
    mean.arrived(1, screen.BLOCK * 4)  # a first copy broke off here
    with pytest.raises(ValueError, match="both in its slot and elsewhere"):
        mean.landed(1, contributions[1].clone())
