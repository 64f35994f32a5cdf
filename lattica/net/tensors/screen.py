"""Screening the contributions to an all-reduce at the member that reduces them.

Theory of operation
-------------------
In the butterfly all-reduce each member owns one part of the flat vector and receives every
other member's slice of it. Before averaging, ``reduce_parts`` decides, once, which of those
slices count:

1. always: a slice with a NaN or an infinity is excluded (shape and dtype were already checked
   by the decoder);
2. ``max_norm_ratio``: with at least three finite slices, one whose L2 norm exceeds
   ``max_norm_ratio`` x the median norm is excluded as an outlier;
3. then, optionally, robust aggregation of what is left: ``clip_ratio`` scales every slice
   down to at most ``clip_ratio`` x the median norm, ``trim`` drops the ``trim`` largest and
   smallest values of every coordinate (a coordinate-wise trimmed mean).

The mean of the accepted slices is what the owner then sends to everyone, so every replica
still receives the same bits; an excluded member's slice simply does not count, and the owner
reports it (``Rejection``) so the caller can score that peer down. A member whose whole
contribution is non-finite is therefore excluded by every owner, i.e. from the round. Sums run
in group order, so the same inputs give the same bits on any machine. If nothing is accepted,
the part is zero (no update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionScreen:
    """What an owner accepts; the default only refuses non-finite contributions."""

    max_norm_ratio: float | None = None
    clip_ratio: float | None = None
    trim: int = 0

    def __post_init__(self) -> None:
        for name in ("max_norm_ratio", "clip_ratio"):
            value = getattr(self, name)
            if value is not None and not value >= 1.0:
                raise ValueError(f"{name} must be at least 1, got {value!r}")
        if self.trim < 0:
            raise ValueError("trim cannot be negative")


DEFAULT_SCREEN = ContributionScreen()


@dataclass(frozen=True, slots=True)
class Rejection:
    peer: str
    reason: str


def reduce_parts(
    parts: Sequence[torch.Tensor], peers: Sequence[str], screen: ContributionScreen = DEFAULT_SCREEN
) -> tuple[torch.Tensor, list[Rejection]]:
    """The screened fp32 mean of ``parts`` (one per peer, in group order) and who was left out."""
    rejected: list[Rejection] = []
    finite: list[int] = []
    for i, part in enumerate(parts):
        if bool(torch.isfinite(part).all()):
            finite.append(i)
        else:
            rejected.append(Rejection(peers[i], "non-finite values"))
    norms = {i: float(torch.linalg.vector_norm(parts[i].to(torch.float32))) for i in finite}
    accepted = finite
    if screen.max_norm_ratio is not None and len(finite) >= 3:
        limit = screen.max_norm_ratio * _median(norms.values())
        accepted = [i for i in finite if norms[i] <= limit]
        rejected += [Rejection(peers[i], f"norm {norms[i]:.3g} > {limit:.3g}") for i in finite if norms[i] > limit]
    if not accepted:
        return torch.zeros(parts[0].numel() if parts else 0, dtype=torch.float32), rejected
    chosen = [parts[i].to(torch.float32) for i in accepted]
    if screen.clip_ratio is not None:
        bound = screen.clip_ratio * _median(norms[i] for i in accepted)
        chosen = [p * min(1.0, bound / norms[i]) if norms[i] > 0 else p for p, i in zip(chosen, accepted, strict=True)]
    if screen.trim and len(chosen) > 2 * screen.trim:
        stacked = torch.stack(chosen).sort(dim=0).values
        return stacked[screen.trim : len(chosen) - screen.trim].mean(dim=0), rejected
    total = chosen[0].clone()
    for p in chosen[1:]:  # group order: the same rounding everywhere
        total += p
    return total.div_(len(chosen)), rejected


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0
