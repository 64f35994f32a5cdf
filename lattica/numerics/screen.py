"""Screening the contributions to an all-reduce at the member that reduces them.

Theory of operation
-------------------
In the butterfly all-reduce each member owns one part of the flat vector and receives every
other member's slice of it. Before averaging, ``reduce_parts`` decides, once, which of those
slices count:

1. always: a slice with a NaN or an infinity is excluded (shape and dtype were already checked
   by the decoder). Such a value makes the sum of the slices non-finite, so with the default
   screen the owner sums first and checks that sum in one pass; only when it is not finite are
   the slices checked one by one and summed again without the excluded ones;
2. ``max_norm_ratio`` (10 in ``DEFAULT_SCREEN``): with at least three finite slices, one whose
   L2 norm exceeds ``max_norm_ratio`` x the median norm is excluded as an outlier. The median is
   an honest member's norm while most members are honest, so one member's scaled-up update
   (x1e30, or a diverged replica) is refused, whatever its direction. With two slices there is
   no majority to tell which one is the outlier, and with a zero median (most slices all zero,
   e.g. parameters most members did not touch) no scale: then nothing is excluded by norm;
3. then, optionally, robust aggregation of what is left: ``clip_ratio`` scales every slice
   down to at most ``clip_ratio`` x the median norm, ``trim`` drops the ``trim`` largest and
   smallest values of every coordinate (a coordinate-wise trimmed mean), ``median`` takes the
   coordinate-wise median (the lower middle value for an even count; of two slices, their
   mean). A trimmed mean of at most
   ``2 * trim`` slices cannot drop anything: it falls back to the mean of what is left and
   logs a warning once per group size.

The mean of the accepted slices is what the owner then sends to everyone, so every replica
still receives the same bits; an excluded member's slice simply does not count, and the owner
reports it (``Rejection``) so the caller can score that peer down. A member whose whole
contribution is non-finite is therefore excluded by every owner, i.e. from the round. Sums run
in group order, so the same inputs give the same bits on any machine. If nothing is accepted,
the part is zero (no update).

``accepted_members`` gives rules 1 and 2's verdicts alone, for an all-gather whose every member
averages the same list itself (SparseLoCo's and DeMo's sparse payloads). Groups that average
without an owner (gossip) judge partners against the receiver's own contribution instead
(``partner_screen``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionScreen:
    """What an owner accepts; ``ContributionScreen()`` only refuses non-finite contributions."""

    max_norm_ratio: float | None = None
    clip_ratio: float | None = None
    trim: int = 0
    median: bool = False

    def __post_init__(self) -> None:
        for name in ("max_norm_ratio", "clip_ratio"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 1.0):
                raise ValueError(f"{name} must be a finite number of at least 1, got {value!r}")
        if self.trim < 0:
            raise ValueError("trim cannot be negative")
        if self.median and self.trim:
            raise ValueError("choose the median or a trimmed mean, not both")

    @property
    def plain(self) -> bool:
        return self.max_norm_ratio is None and self.clip_ratio is None and not self.trim and not self.median


# what a daemon uses unless ``[train]`` says otherwise: non-finite and scaled-up updates refused
DEFAULT_MAX_NORM_RATIO = 10.0
DEFAULT_SCREEN = ContributionScreen(max_norm_ratio=DEFAULT_MAX_NORM_RATIO)
PLAIN_MEAN = ContributionScreen()
_warned_trim: set[tuple[int, int]] = set()  # (contributions, trim) already warned about
BLOCK = 1 << 16  # fp32 elements (256 KiB): a block of every part stays in cache through its additions


@dataclass(frozen=True, slots=True)
class Rejection:
    peer: str
    reason: str


def reduce_parts(
    parts: Sequence[torch.Tensor], peers: Sequence[str], screen: ContributionScreen = DEFAULT_SCREEN,
    *, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[Rejection]]:
    """The screened fp32 mean of ``parts`` (one per peer, in group order) and who was left out.

    The mean is written into ``out`` (an fp32 tensor of the parts' length) when given, else
    into a new tensor; a part must not share memory with ``out``.
    """
    numel = parts[0].numel() if parts else 0
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    if parts and only_screens_norms(screen):
        # the common case, on this thread as in ``_plain_mean_into``: finite parts of similar
        # norms give their plain mean; anything else takes the exact path below
        floats = [p.to(torch.float32) for p in parts]
        ratio = screen.max_norm_ratio
        squares: list[float] | None = None if ratio is None else []
        if _plain_mean_into(out, floats, squares) and (
            ratio is None or squares is None or no_norm_outlier([math.sqrt(q) for q in squares], ratio)
        ):
            return out, []
    accepted, rejected, norms = _screened(parts, peers, screen)
    if not accepted:
        return out.zero_(), rejected
    chosen = [parts[i].to(torch.float32) for i in accepted]
    if screen.clip_ratio is not None:
        bound = screen.clip_ratio * _median(norms[i] for i in accepted)
        chosen = [p * min(1.0, bound / norms[i]) if norms[i] > 0 else p for p, i in zip(chosen, accepted, strict=True)]
    if screen.median and len(chosen) > 2:
        out.copy_(torch.stack(chosen).median(dim=0).values)
        return out, rejected
    if screen.trim and len(chosen) > 2 * screen.trim:
        stacked = torch.stack(chosen).sort(dim=0).values
        torch.mean(stacked[screen.trim : len(chosen) - screen.trim], dim=0, out=out)
        return out, rejected
    if screen.trim and (len(chosen), screen.trim) not in _warned_trim:
        _warned_trim.add((len(chosen), screen.trim))
        log.warning(
            "trimmed mean (trim %d) needs at least %d contributions, got %d: taking their plain mean",
            screen.trim, 2 * screen.trim + 1, len(chosen),
        )
    _sum_into(out, chosen)
    return out.div_(len(chosen)), rejected


def accepted_members(
    parts: Sequence[torch.Tensor], peers: Sequence[str], screen: ContributionScreen = DEFAULT_SCREEN,
) -> tuple[list[int], list[Rejection]]:
    """Which of ``parts`` (one flat tensor per peer, in group order) rules 1 and 2 accept, by
    index, and who is refused: the verdicts ``reduce_parts`` reaches, for callers that average
    the accepted contributions themselves (an all-gather, where every member judges the same
    list and so reaches the same verdict)."""
    accepted, rejected, _ = _screened(parts, peers, screen)
    return accepted, rejected


def _screened(
    parts: Sequence[torch.Tensor], peers: Sequence[str], screen: ContributionScreen,
) -> tuple[list[int], list[Rejection], dict[int, float]]:
    """Rules 1 and 2: the accepted indices, the refusals and the finite parts' norms (when a
    norm rule needs them)."""
    rejected: list[Rejection] = []
    finite: list[int] = []
    for i, part in enumerate(parts):
        if _all_finite(part):
            finite.append(i)
        else:
            rejected.append(Rejection(peers[i], "non-finite values"))
    norms: dict[int, float] = {}
    if screen.max_norm_ratio is not None or screen.clip_ratio is not None:
        norms = {i: float(torch.linalg.vector_norm(parts[i].to(torch.float32))) for i in finite}
    accepted = finite
    median_norm = _median(norms.values()) if screen.max_norm_ratio is not None and len(finite) >= 3 else 0.0
    if screen.max_norm_ratio is not None and median_norm > 0:
        limit = screen.max_norm_ratio * median_norm
        accepted = [i for i in finite if norms[i] <= limit]
        rejected += [Rejection(peers[i], f"norm {norms[i]:.3g} > {limit:.3g}") for i in finite if norms[i] > limit]
    return accepted, rejected, norms


def only_screens_norms(screen: ContributionScreen) -> bool:
    return screen.clip_ratio is None and not screen.trim and not screen.median


def no_norm_outlier(norms: Sequence[float], ratio: float) -> bool:
    """Every norm finite and none above ``ratio`` x the median (as the exact path decides)."""
    if not all(math.isfinite(n) for n in norms):
        return False
    median = _median(norms)
    return len(norms) < 3 or median <= 0 or max(norms) <= ratio * median


def _norm(part: torch.Tensor) -> float:
    """The L2 norm of an fp32 part, block by block on this thread (no intra-op workers)."""
    if not part.is_contiguous():
        return float(torch.linalg.vector_norm(part))
    a = part.detach().reshape(-1).numpy()
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, a.size, BLOCK):
            block = a[start : start + BLOCK]
            total += float(np.einsum("i,i->", block, block))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def _plain_mean_into(out: torch.Tensor, parts: Sequence[torch.Tensor], squares: list[float] | None = None) -> bool:
    """``out = (parts[0] + parts[1] + ...) / len(parts)`` if every part is finite, else False.

    The sum is checked, not the parts: a NaN or an infinity in any part makes its element of
    the sum non-finite, so a finite sum proves every part finite. It runs block by block, each
    block staying in cache through all its additions, on this thread alone (numpy): the same
    rounding as ``_sum_into`` and IEEE division, so the bits do not depend on the thread count,
    and no intra-op worker threads are woken (on a loaded host they spin waiting for a core).
    With ``squares`` (an empty list), every part's sum of squares is appended to it, computed
    from the same blocks while they are in cache: the norm screen costs no extra pass over
    the parts.
    """
    if not (out.is_contiguous() and all(p.is_contiguous() for p in parts)):
        _sum_into(out, parts)
        if not math.isfinite(float(out.sum())):
            return False
        if squares is not None:
            squares.extend(_norm(p) ** 2 for p in parts)
        out.div_(len(parts))
        return True
    o, ps = out.detach().numpy(), [p.detach().numpy() for p in parts]
    total = 0.0
    sums_of_squares = [0.0] * len(ps)
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite sums are handled below
        for start in range(0, o.size, BLOCK):
            ob, pb = o[start : start + BLOCK], [p[start : start + BLOCK] for p in ps]
            if squares is not None:
                for i, block in enumerate(pb):
                    sums_of_squares[i] += float(np.einsum("i,i->", block, block))
            if len(pb) == 1:
                np.copyto(ob, pb[0])
            else:
                np.add(pb[0], pb[1], out=ob)
                for q in pb[2:]:
                    np.add(ob, q, out=ob)
            total += float(ob.sum())
            np.divide(ob, np.float32(len(parts)), out=ob)
    if not math.isfinite(total):
        return False
    if squares is not None:
        squares.extend(q if math.isfinite(q) else math.inf for q in sums_of_squares)
    return True


def _sum_into(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """``out = parts[0] + parts[1] + ...`` in group order (the same rounding everywhere)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)


def _all_finite(part: torch.Tensor) -> bool:
    # A NaN or an infinity makes the sum non-finite, so a finite sum proves every element
    # finite in one cheap pass; only a non-finite sum (or an overflow) needs the exact check.
    if math.isfinite(float(part.sum())):
        return True
    return bool(torch.isfinite(part).all())


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0
