"""Learning-rate schedule of the inner optimizer: linear warmup, then cosine decay.

DiLoCo (Douillard et al., 2023) trains the inner AdamW with warmup + cosine over the whole run;
the schedule is a pure function of the inner step, so a resumed or joining peer recomputes it
from the step number alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """``lr`` peaks after ``warmup_steps`` and decays to ``min_lr_ratio * lr`` at ``total_steps``."""

    lr: float = 3e-3
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"ScheduleConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"ScheduleConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise ValueError(f"ScheduleConfig.total_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"ScheduleConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
            )


def lr_multiplier(step: int, config: ScheduleConfig) -> float:
    """Factor applied to ``config.lr`` at inner step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    decay_steps = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def warmup_cosine(
    optimizer: torch.optim.Optimizer, config: ScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` on ``optimizer`` (whose base lr should be ``config.lr``)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))
