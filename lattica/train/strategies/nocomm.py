"""No-communication baseline: every replica trains alone (the lower bound DiLoCo must beat)."""

from __future__ import annotations

import torch

from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.strategies.accounting import AccountedStrategy
from lattica.train.strategies.base import GroupProvider, OuterStepReport


class NoComm(AccountedStrategy[None]):
    name = "nocomm"
    config_class = None

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups)

    @property
    def completed_rounds(self) -> int:
        return 0

    def next_sync_step(self, step: int) -> None:
        return None

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        return []

    def outer_state_dict(self) -> StateDict:
        return {}

    def load_outer_state_dict(self, state: StateDict) -> None:
        return None
