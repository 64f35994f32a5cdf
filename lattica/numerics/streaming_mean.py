"""The owner's mean of an all-reduce part, summed while the contributions are still arriving.

Theory of operation
-------------------
The owner of a part receives one contribution per member into its own slot, frame by frame,
each frame decrypted just before it lands. Summing only after every contribution arrived reads
them all back from memory; ``StreamingMean`` instead sums the elements every contribution has
already reached (``arrived(j, nbytes)`` after each frame; the prefix common to all of them),
block by block, while the newest frames are still in cache. A contribution that came before
its slot was offered lands elsewhere whole (``landed``) and is summed from there:

- the sum of every block is taken in group order and divided once (``parts[0] + parts[1] +
  ... `` then ``/ n``), as ``screen.reduce_parts`` does, so the bits are those of the
  exact path whatever the order in which frames arrive;
- every contribution's sum of squares is accumulated from the same blocks. A finite sum of
  squares proves the contribution finite (a NaN or an infinity, or a value beyond ~1.8e19,
  makes it non-finite), so the non-finite screen costs no pass of its own;
- the verdict is reached once, in ``finish``, when everything arrived: if every contribution
  is finite and no norm exceeds ``max_norm_ratio`` x the median (rule 2 of ``screen.py``,
  with the norms from the sums of squares), the streamed mean stands. Otherwise the part is
  recomputed from the contributions, which stay intact in their slots, by
  ``screen.reduce_parts``: its exact path excludes the non-finite and outlying ones, reports
  them, and averages the rest. The screen's rules are the same with or without streaming;
  streaming only changes when the honest case's sums are taken.

When the mean is written over this member's own contribution (an in-place all-reduce), each
block of it is first copied into ``keep`` (its free slot), so the exact path still finds it.
Only screens that look at norms alone can stream (``screen.only_screens_norms``): clipping, trimming and
the median need every contribution at once.

Everything runs on the calling thread with numpy (no intra-op worker threads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from lattica.numerics.screen import (
    BLOCK,
    ContributionScreen,
    Rejection,
    no_norm_outlier,
    reduce_parts,
)


class StreamingMean:
    """Sums contributions (fp32, one per member in group order) into ``out`` as they arrive.

    ``parts[j]`` is the slot contribution ``j`` lands in; ``arrived(j, nbytes)`` tells that
    its first ``nbytes`` are in place. Contributions already whole (this member's own) are
    listed in ``whole``. With ``keep``, ``parts[keep_index]`` is a copy, made block by block
    just before the block is summed, of ``out`` itself (the own contribution of an in-place
    all-reduce).
    """

    def __init__(
        self, parts: Sequence[torch.Tensor], out: torch.Tensor, *, whole: Sequence[int] = (),
        keep_index: int | None = None,
    ) -> None:
        numel = out.numel()
        if any(p.numel() != numel or p.dtype != torch.float32 or not p.is_contiguous() for p in parts):
            raise ValueError("streamed contributions must be contiguous fp32 tensors of the part's length")
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("the streamed mean needs a contiguous fp32 output")
        self._parts = [p.detach().reshape(-1).numpy() for p in parts]
        self._out = out.detach().reshape(-1).numpy()
        self._keep = keep_index
        self._filled = [numel if j in whole else 0 for j in range(len(parts))]
        self._done = 0  # elements [0, done) are summed and divided
        self.squares = [0.0] * len(parts)

    @property
    def summed(self) -> int:
        """How many leading elements of the mean are already summed."""
        return self._done

    def arrived(self, j: int, nbytes: int) -> None:
        """Contribution ``j`` holds its first ``nbytes``: sum whatever every one has reached,
        in whole blocks (the last, partial block waits for ``finish``)."""
        self._filled[j] = max(self._filled[j], min(nbytes // 4, self._out.size))
        reach = min(self._filled)
        if reach < self._out.size:
            reach -= reach % BLOCK
        if reach > self._done:
            self._sum(self._done, reach)

    def landed(self, j: int, contribution: torch.Tensor) -> None:
        """Contribution ``j`` is whole in ``contribution``: its slot, or a buffer of its own
        when it arrived before the slot was offered (nothing of it is summed yet then).

        ``ValueError`` when part of another copy of it already reached the slot (a sender
        never sends a contribution twice once any of it left: the caller treats that as a
        protocol violation by the sender).
        """
        if contribution.numel() != self._out.size or contribution.dtype != torch.float32:
            raise ValueError("a streamed contribution must be an fp32 tensor of the part's length")
        values = contribution.detach().reshape(-1).numpy()
        if values.ctypes.data != self._parts[j].ctypes.data:
            if self._filled[j]:
                raise ValueError(f"contribution {j} arrived both in its slot and elsewhere")
            self._parts[j] = values
        self.arrived(j, self._out.size * 4)

    def finish(self, screen: ContributionScreen, peers: Sequence[str]) -> list[Rejection]:
        """Sum the rest (every contribution ``landed``), screen, and return who was left out.

        The streamed mean stands when every contribution is finite and none is a norm
        outlier; otherwise ``out`` is recomputed by ``reduce_parts`` from the intact slots.
        """
        if min(self._filled) < self._out.size:
            raise ValueError("a contribution has not landed yet")
        if self._done < self._out.size:
            self._sum(self._done, self._out.size)
        norms = [math.sqrt(q) if math.isfinite(q) else math.inf for q in self.squares]
        ratio = screen.max_norm_ratio
        if all(math.isfinite(n) for n in norms) and (ratio is None or no_norm_outlier(norms, ratio)):
            return []
        parts = [torch.from_numpy(p) for p in self._parts]
        _, rejected = reduce_parts(parts, peers, screen, out=torch.from_numpy(self._out))
        return rejected

    def _sum(self, start: int, stop: int) -> None:
        out, parts, n = self._out, self._parts, len(self._parts)
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite sums are screened in finish
            for lo in range(start, stop, BLOCK):
                hi = min(lo + BLOCK, stop)
                ob = out[lo:hi]
                if self._keep is not None:
                    np.copyto(parts[self._keep][lo:hi], ob)
                for i, part in enumerate(parts):  # each block's square and add back to back
                    block = part[lo:hi]
                    self.squares[i] += float(np.einsum("i,i->", block, block))
                    if n == 1:
                        np.copyto(ob, block)
                    elif i == 1:
                        np.add(parts[0][lo:hi], block, out=ob)
                    elif i > 1:
                        np.add(ob, block, out=ob)
                np.divide(ob, np.float32(n), out=ob)
        self._done = stop
