"""Screening what group partners send, at the replica that averages it.

Theory of operation
-------------------
Where replicas average inside small groups (gossip DiLoCo, NoLoCo, SPES and SparseLoCo with
``averaging = "gossip"``), each replica averages its own contribution with what its partners
sent, for itself alone: no owner decides for everyone, and a group of two has no majority to
tell which member is the outlier. So before averaging, the receiver judges each partner's
contribution against what it trusts — its own contribution and its own recent history —
in ``PartnerScreen.screen``:

1. always: a partner's contribution with a NaN or an infinity anywhere is refused; with no
   partner's accepted (a group of two), the replica keeps its own, as when it is alone. Its
   own contribution always counts: a replica whose own update is not finite ruins only itself,
   since its partners refuse it;
2. ``max_norm_ratio`` (the run's ``max_norm_ratio``, 10 by default; None: off): a contribution
   is cut into named segments (DiLoCo's φ and Δ, SPES's dense weights and each expert, a sparse
   update ŝ), and a partner's segment whose L2 norm exceeds ``max_norm_ratio`` × the reference
   is refused with the whole contribution. The reference of a segment is the larger of this
   replica's own norm for it now and the median of its own last ``history`` (16) finite norms
   for it. Only this replica's own norms enter the reference, so no partner — nor several
   colluding ones — can move it; the history keeps one unusually small own update (a short
   phase, a replica that fell behind) from refusing honest partners. A zero reference (a
   segment this replica has never seen non-zero) gives no scale: nothing is refused by norm.
   A norm that overflows fp32 (finite values above about 1.8e19 in norm) counts as infinite
   and is refused whatever the reference.

Verdicts depend on the contributions and this replica's history only, never on the order in
which partners answered; the accepted contributions are then averaged exactly as without a
screen, so honest partners within the ratio give the same bits as before. Every refusal is
counted per peer (``refused``) and handed to ``on_refused`` (the daemon scores the peer down
and leaves it out of its next group draws, ``coordination.avoidance``).

What it does not protect against: a contribution within ``max_norm_ratio`` of the reference
however wrong its direction (a sign flip, a random vector of ordinary size, weights of a
different model, small ones or zeros: a segment is judged from above only), which the mean
then carries at its weight in the group (one half in a pair); a partner that behaves towards
this replica and not towards others. It bounds what one exchange can do to a replica's
weights, and keeps non-finite values out of them.

Where replicas must agree (an all-gather whose every member averages the same list, SPES's
expert copies in an all-reduce run) the receiver's own history would make verdicts differ
between members: those paths use ``screen.accepted_members`` (the all-reduce owner's rules)
or ``refusal`` against a reference every member holds, never this class.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lattica.numerics.screen import DEFAULT_MAX_NORM_RATIO, Rejection

log = logging.getLogger(__name__)

DEFAULT_HISTORY = 16  # own norms per segment the reference looks back on

Segments = Mapping[str, Sequence[torch.Tensor]]
"""A contribution cut into named segments (``{"phi": [...], "delta": [...]}``), judged one by one."""


def segment_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm over ``tensors`` (fp32): NaN when a value is not finite, infinity when
    finite values overflow fp32."""
    total = 0.0
    for tensor in tensors:
        norm = float(torch.linalg.vector_norm(tensor.detach().to(torch.float32)))
        if not math.isfinite(norm):
            return math.inf if bool(torch.isfinite(tensor).all()) else math.nan
        total += norm * norm
    return math.sqrt(total)


def refusal(
    peer: str, norms: Mapping[str, float], references: Mapping[str, float], ratio: float | None,
) -> Rejection | None:
    """Why ``peer``'s contribution (its segments' ``norms``) is refused against ``references``
    (segment -> reference norm), or None when it is accepted (module docstring, rules 1 and 2)."""
    for name, norm in norms.items():
        if math.isnan(norm):
            return Rejection(peer, f"non-finite values in {name}")
        if math.isinf(norm):
            return Rejection(peer, f"norm of {name} overflows")
        reference = references.get(name, 0.0)
        if ratio is not None and reference > 0 and norm > ratio * reference:
            return Rejection(peer, f"norm of {name} {norm:.3g} > {ratio:g} x {reference:.3g}")
    return None


@dataclass(frozen=True, slots=True)
class Screened:
    """A screen's verdict: the partners whose contributions count (in the order given) and the
    refusals."""

    accepted: tuple[str, ...]
    rejected: tuple[Rejection, ...]


class PartnerScreen:
    """Judges partners' contributions against this replica's own and its history (module
    docstring). ``on_refused`` is called once per refused contribution, after the verdict."""

    def __init__(
        self, max_norm_ratio: float | None = DEFAULT_MAX_NORM_RATIO, *, history: int = DEFAULT_HISTORY,
        on_refused: Callable[[Rejection], None] | None = None,
    ) -> None:
        if max_norm_ratio is not None and not (math.isfinite(max_norm_ratio) and max_norm_ratio >= 1.0):
            raise ValueError(f"max_norm_ratio must be a finite number of at least 1, got {max_norm_ratio!r}")
        if history < 1:
            raise ValueError(f"history must be at least 1, got {history!r}")
        self.max_norm_ratio = max_norm_ratio
        self.on_refused = on_refused or _log_refusal
        self.refused: Counter[str] = Counter()  # peer -> contributions refused
        self._history = history
        self._own_norms: dict[str, deque[float]] = {}

    def screen(self, own: Segments, received: Mapping[str, Segments]) -> Screened:
        """The verdict on ``received`` (peer -> its segments) against ``own`` (this replica's
        segments, the same names); this replica's own finite norms join its history."""
        own_norms = {name: segment_norm(tensors) for name, tensors in own.items()}
        references = {name: self._reference(name, norm) for name, norm in own_norms.items()}
        accepted: list[str] = []
        rejected: list[Rejection] = []
        for peer, segments in received.items():
            why = refusal(peer, {name: segment_norm(t) for name, t in segments.items()}, references,
                          self.max_norm_ratio)
            if why is None:
                accepted.append(peer)
            else:
                rejected.append(why)
        self._remember(own_norms)
        for rejection in rejected:
            self.refuse(rejection)
        return Screened(tuple(accepted), tuple(rejected))

    def refuse(self, rejection: Rejection) -> None:
        """Count a refused contribution against its peer and report it (``on_refused``); for
        verdicts reached outside ``screen`` too (an all-gather's, SPES's expert copies)."""
        self.refused[rejection.peer] += 1
        self.on_refused(rejection)

    def _reference(self, name: str, own_norm: float) -> float:
        recent = sorted(self._own_norms.get(name, ()))
        median = recent[(len(recent) - 1) // 2] if recent else 0.0
        return max(own_norm if math.isfinite(own_norm) else 0.0, median)

    def _remember(self, own_norms: Mapping[str, float]) -> None:
        for name, norm in own_norms.items():
            if math.isfinite(norm):
                self._own_norms.setdefault(name, deque(maxlen=self._history)).append(norm)


def _log_refusal(rejection: Rejection) -> None:
    log.warning("refused %s's contribution: %s", rejection.peer, rejection.reason)
