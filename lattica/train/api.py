"""A small Python API for training scripts that own their loop.

    from lattica.training_node import open_node

    config = NodeConfig(data_dir=Path("node"), listen=("/ip4/0.0.0.0/tcp/4001",), peers=(...))
    async with open_node(config) as node:          # a Lattica node in this process
        await node.wait_for_members(2)              # optional: start with the others
        model, inner = MyModel(), torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = wrap(model, inner, node=node, strategy="diloco",
                     config=DiLoCoConfig(inner_steps=100))
        async with trio.open_nursery() as nursery:
            outer.bind_nursery(nursery)
            for x, y in batches:
                loss = loss_fn(model(x), y)      # or in trio.to_thread.run_sync
                loss.backward()
                reports = await outer.step()     # inner step + outer round every H steps
                outer.zero_grad()
            await outer.finish()

``open_node`` (``lattica.training_node``) runs a Lattica node in the script's process and hands
out what ``wrap`` needs: ``.collective`` and ``.groups``; any object with those two (an
in-memory ``Collective`` and a fixed ``GroupProvider`` in tests) will do. ``OuterOptimizer.step``
is what the built-in ``Trainer`` does between two inner steps, so a user's loop and
``lattica join --task`` behave the same.
"""

from __future__ import annotations

from typing import Protocol

import torch
import trio

from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.strategies import create_strategy
from lattica.train.strategies.base import GroupProvider, OuterStepReport, OuterStrategy


class Node(Protocol):
    """What the API needs from a node: its data-plane collective and round membership."""

    @property
    def collective(self) -> Collective: ...

    @property
    def groups(self) -> GroupProvider: ...


class OuterOptimizer:
    """A user's inner optimizer with an outer strategy around it."""

    def __init__(self, inner: torch.optim.Optimizer, strategy: OuterStrategy[object]) -> None:
        self.inner = inner
        self.strategy = strategy
        self.step_count = 0

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        self.strategy.bind_nursery(nursery)

    async def step(self) -> list[OuterStepReport]:
        """Apply the inner optimizer (in a worker thread) and let the strategy sync."""
        step = self.step_count + 1
        if self.strategy.syncs_gradients:
            await self.strategy.before_optimizer_step(step)
        await trio.to_thread.run_sync(self.inner.step)
        self.step_count = step
        return await self.strategy.after_inner_step(step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    async def finish(self) -> list[OuterStepReport]:
        return await self.strategy.finish()

    @property
    def completed_rounds(self) -> int:
        return self.strategy.completed_rounds

    def state_dict(self) -> StateDict:
        return {
            "step": self.step_count,
            "inner": self.inner.state_dict(),
            "outer": self.strategy.outer_state_dict(),
        }

    def load_state_dict(self, state: StateDict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.strategy.load_outer_state_dict(state["outer"])
        self.step_count = int(state["step"])


def wrap(
    model: torch.nn.Module,
    inner: torch.optim.Optimizer,
    *,
    node: Node,
    strategy: str = "diloco",
    config: object | None = None,
) -> OuterOptimizer:
    """Wrap ``model`` and its inner optimizer with the named outer strategy on ``node``."""
    outer = create_strategy(
        strategy, model, collective=node.collective, groups=node.groups, config=config
    )
    return OuterOptimizer(inner, outer)
