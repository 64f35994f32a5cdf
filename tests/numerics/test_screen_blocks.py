"""The default screen's norms come from the same block-by-block pass as the mean.

``reduce_parts`` sums the parts a block at a time and takes every part's sum of squares from
the same blocks; a verdict must not depend on where a part's mass lies relative to the block
boundaries, and the mean must be the plain mean's bits.
"""

from __future__ import annotations

import torch

from lattica.numerics import screen
from lattica.numerics.screen import PLAIN_MEAN, reduce_parts

PEERS = ["a", "b", "c", "d"]


def _parts(numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) for _ in PEERS]


def test_an_outlier_whose_mass_lies_in_the_last_block_is_excluded() -> None:
    numel = 3 * screen.BLOCK + 17
    parts = _parts(numel)
    parts[2][-10:] = 1e6  # finite, its norm ~3e6 against honest norms of ~900
    mean, rejected = reduce_parts(parts, PEERS)
    assert [r.peer for r in rejected] == ["c"]
    expected, _ = reduce_parts([p for i, p in enumerate(parts) if i != 2], ["a", "b", "d"], PLAIN_MEAN)
    assert torch.equal(mean, expected)


def test_the_screened_mean_over_many_blocks_is_the_plain_mean_bit_for_bit() -> None:
    parts = _parts(2 * screen.BLOCK + 5)
    out = torch.empty_like(parts[0])
    mean, rejected = reduce_parts(parts, PEERS, out=out)
    plain, _ = reduce_parts(parts, PEERS, PLAIN_MEAN)
    assert rejected == []
    assert mean.data_ptr() == out.data_ptr()
    assert torch.equal(mean, plain)
    assert torch.equal(mean, (parts[0] + parts[1] + parts[2] + parts[3]) / 4)
