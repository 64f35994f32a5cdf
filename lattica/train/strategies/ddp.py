"""Data-parallel baseline: average the gradients of every inner step over the group.

Equivalent to DDP with the global batch split across the members: each member computes its
gradient, the mean replaces it before ``optimizer.step()``, so replicas never diverge. It sends
one full all-reduce per step — the yardstick DiLoCo's communication is compared with.

The gradients go to the collective as fp32 host copies, which the data plane sends; with
``reduce_on_device`` (a collective that averages accelerator tensors where they are, as the
convergence harness's in-memory one does on CUDA) they stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.strategies.accounting import AccountedStrategy
from lattica.train.strategies.base import GroupProvider, OuterStepReport
from lattica.train.strategies.traffic import allreduce_bytes


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    codec: str = "fp32"
    reduce_on_device: bool = False  # hand the collective the gradients where they are


class DDP(AccountedStrategy[DDPConfig]):
    name = "ddp"
    config_class = DDPConfig
    syncs_gradients = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: DDPConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._synced = 0

    @property
    def completed_rounds(self) -> int:
        return self._synced

    async def before_optimizer_step(self, step: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        where = None if self.config.reduce_on_device else "cpu"
        sent = [g.detach().to(device=where, dtype=torch.float32) for g in grads]
        group = tuple(await self.groups.group_for(f"step/{step}"))
        self.traffic.record_sync(allreduce_bytes(sent, len(group), self.config.codec))
        mean = await self.collective.allreduce(
            sent, group=group, tag=f"ddp/step/{step}", codec=self.config.codec
        )
        with torch.no_grad():
            for param, averaged in zip(self._params, mean, strict=True):
                param.grad = averaged.to(param.device, param.dtype)
        self._synced += 1

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        return []

    def outer_state_dict(self) -> StateDict:
        return {"round": self._synced}

    def load_outer_state_dict(self, state: StateDict) -> None:
        self._synced = int(state.get("round", 0))
