"""Outer strategies by name.

``STRATEGIES`` maps a name to ``"module:Class"``; classes are imported on first use, so adding a
strategy is one line here and an optional module does not slow down the others. Every class
takes ``(model, *, collective, groups, config=None)`` and names its config dataclass in
``config_class``.
"""

from __future__ import annotations

import importlib

import torch

from lattica.config import StrategyName
from lattica.train.engine.collective import Collective
from lattica.train.strategies.base import GroupProvider, OuterStepReport, OuterStrategy

STRATEGIES: dict[StrategyName, str] = {
    "diloco": "lattica.train.strategies.diloco:DiLoCo",
    "ddp": "lattica.train.strategies.ddp:DDP",
    "nocomm": "lattica.train.strategies.nocomm:NoComm",
    "noloco": "lattica.train.strategies.noloco:NoLoCo",
    "eager": "lattica.train.strategies.eager:EagerDiLoCo",
    "streaming": "lattica.train.strategies.streaming:StreamingDiLoCo",
    "streaming_eager": "lattica.train.strategies.streaming_eager:StreamingEagerDiLoCo",
    "spes": "lattica.train.strategies.spes:SPES",
    "sparseloco": "lattica.train.strategies.sparseloco:SparseLoCo",
    "demo": "lattica.train.strategies.demo_momentum:DeMo",
    "local_adam": "lattica.train.strategies.desloc:LocalAdam",
    "desloc": "lattica.train.strategies.desloc:DESLOC",
    "co2": "lattica.train.strategies.co2:CO2",
}


def strategy_class(name: str) -> type[OuterStrategy[object]]:
    """The class registered under ``name``; ``ValueError`` lists the known names."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    target = STRATEGIES[name]
    module_name, _, class_name = target.partition(":")
    cls: type[OuterStrategy[object]] = getattr(importlib.import_module(module_name), class_name)
    return cls


def create_strategy(
    name: str,
    model: torch.nn.Module,
    *,
    collective: Collective,
    groups: GroupProvider,
    config: object | None = None,
) -> OuterStrategy[object]:
    """Instantiate strategy ``name`` around ``model`` (default config when ``config`` is None)."""
    cls = strategy_class(name)
    return cls(model, collective=collective, groups=groups, config=config)


__all__ = [
    "STRATEGIES",
    "GroupProvider",
    "OuterStepReport",
    "OuterStrategy",
    "create_strategy",
    "strategy_class",
]
