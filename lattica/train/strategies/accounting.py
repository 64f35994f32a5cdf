"""Per-node traffic and memory accounting shared by the outer strategies.

Every strategy counts what it puts on the wire itself, from the encoded size of the tensors it
hands to the ``Collective`` (the same sizes the data plane sends): an ``exchange`` costs its
payload, a butterfly ``allreduce`` over ``n`` members costs ``2 (n - 1) / n`` of it (see
``traffic.py``). A "sync" is
one unit of communication the strategy starts (a DiLoCo round, one Streaming fragment, one
NoLoCo group exchange), so ``peak_sync_bytes`` is the largest burst a node puts on its link.

Memory: ``optimizer_state_bytes`` adds the inner optimizer's state tensors (read from
``optimizer.state``, so lazily created state — e.g. none for frozen SPES experts — counts only
once it exists) and the strategy's own outer state (outer weights, momentum buffers).
``accounting()`` gathers these figures, plus the model's trainable and frozen parameter bytes,
for the daemon's metrics (``lattica_strategy_*``, ``lattica_*_state_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lattica.train.engine.collective import Collective
from lattica.train.strategies.base import ConfigT, GroupProvider, OuterStrategy


@dataclass
class TrafficMeter:
    """Bytes this node sent: in total, in the last sync, and in the largest sync so far."""

    bytes_sent: int = 0
    last_sync_bytes: int = 0
    peak_sync_bytes: int = 0
    syncs: int = 0

    def record_sync(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.last_sync_bytes = nbytes
        self.peak_sync_bytes = max(self.peak_sync_bytes, nbytes)
        self.syncs += 1


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor held in ``optimizer.state`` (0 without an optimizer)."""
    if optimizer is None:
        return 0
    return sum(
        tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
        for state in optimizer.state.values()
    )


class AccountedStrategy(OuterStrategy[ConfigT]):
    """An ``OuterStrategy`` that exposes traffic and memory figures for the metrics layer.

    Attributes read by metrics: ``traffic`` (a ``TrafficMeter``), ``outer_state_bytes`` and
    ``optimizer_state_bytes``. The trainer may ``attach_inner_optimizer`` so that inner state is
    counted too (and so that SPES can drop the state of experts it stops owning).
    """

    def __init__(
        self, model: torch.nn.Module, *, collective: Collective, groups: GroupProvider, config: ConfigT | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        self.traffic = TrafficMeter()
        self.inner_optimizer: torch.optim.Optimizer | None = None

    def attach_inner_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner_optimizer = optimizer

    @property
    def outer_state_bytes(self) -> int:
        return 0

    @property
    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self.inner_optimizer) + self.outer_state_bytes

    def accounting(self) -> dict[str, int]:
        """This node's traffic and memory figures, as exported in the Prometheus metrics."""
        params = list(self.model.parameters())
        return {
            "bytes_sent": self.traffic.bytes_sent,
            "syncs": self.traffic.syncs,
            "last_sync_bytes": self.traffic.last_sync_bytes,
            "peak_sync_bytes": self.traffic.peak_sync_bytes,
            "inner_optimizer_state_bytes": optimizer_state_bytes(self.inner_optimizer),
            "outer_state_bytes": self.outer_state_bytes,
            "trainable_parameter_bytes": tensor_bytes(p for p in params if p.requires_grad),
            "frozen_parameter_bytes": tensor_bytes(p for p in params if not p.requires_grad),
        }
