"""What the trainer reports: progress records, completed rounds, and the summary of a run.

``Trainer`` hands a ``Progress`` to ``on_progress`` every ``log_every`` steps (and after
validations), a ``RoundCompleted`` to ``on_round`` for every outer round applied or skipped,
and returns a ``TrainingSummary`` from ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from lattica.train.engine.checkpoint import StateDict, weights_hash
from lattica.train.engine.outer_state import outer_state_hash
from lattica.train.strategies.base import OuterStepReport


@dataclass(frozen=True)
class Progress:
    """One progress record (every ``log_every`` steps, after validations and at the end)."""

    step: int
    round: int
    loss: float
    tokens_per_s: float
    lr: float
    val_loss: float | None = None
    mfu: float | None = None  # model FLOPs utilisation (CUDA, a known device, the built-in GPT)


@dataclass(frozen=True)
class RoundCompleted:
    """An outer round was applied (or skipped) at inner step ``step``.

    The content hashes are computed from the outer state taken at that moment, on first access
    only: hashing the whole outer state costs milliseconds, and a Streaming run completes a
    fragment sync every H/P steps while the inner steps wait.
    """

    step: int
    report: OuterStepReport
    outer_state: StateDict | None = field(default=None, repr=False)  # None when skipped

    @cached_property
    def weights_hash(self) -> str | None:
        """Of the outer weights: publish with the round number."""
        params = (self.outer_state or {}).get("params")
        return weights_hash(params) if params else None

    @cached_property
    def state_hash(self) -> str | None:
        """Of weights + outer optimizer state: what joiners verify."""
        params = (self.outer_state or {}).get("params")
        return outer_state_hash(self.outer_state) if params and self.outer_state else None


@dataclass(frozen=True)
class TrainingSummary:
    steps: int
    rounds: int
    train_loss: float
    val_loss: float | None
    tokens: int
    seconds: float
    bytes_sent: int
    first_loss: float | None = None  # the train loss of the first report since this trainer started
