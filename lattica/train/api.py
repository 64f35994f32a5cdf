"""A small Python API for training scripts that own their loop.

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

``open_node`` runs the node of ``lattica join`` (libp2p host, access control, control socket,
bootstrap, peer exchange, the replicated run state, the DHT where enabled) plus the training
data plane and the round coordinator, and hands out what ``wrap`` needs: ``.collective`` and
``.groups``. The round candidates are the run's live members that registered as trainers, so
scripts on several machines (or ``lattica join --train`` daemons of the same strategy) train
together. ``OuterOptimizer.step`` is what the built-in ``Trainer`` does between two inner steps,
so a user's loop and ``lattica join --task`` behave the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import trio
from libp2p.crypto.keys import KeyPair
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.net.tensors.screen import DEFAULT_SCREEN, ContributionScreen
from lattica.train.collective import Collective
from lattica.train.strategies import create_strategy
from lattica.train.strategies.base import GroupProvider, OuterStepReport, OuterStrategy

if TYPE_CHECKING:
    from lattica.services import NodeContext, NodeService


class Node(Protocol):
    """What the API needs from a node: its data-plane collective and round membership."""

    @property
    def collective(self) -> Collective: ...

    @property
    def groups(self) -> GroupProvider: ...


class OuterOptimizer:
    """A user's inner optimizer with an outer strategy around it."""

    def __init__(self, inner: torch.optim.Optimizer, strategy: OuterStrategy) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "inner": self.inner.state_dict(),
            "outer": self.strategy.outer_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.strategy.load_outer_state_dict(state["outer"])
        self.step_count = int(state["step"])


def wrap(
    model: torch.nn.Module,
    inner: torch.optim.Optimizer,
    *,
    node: Node,
    strategy: str = "diloco",
    config: Any = None,
) -> OuterOptimizer:
    """Wrap ``model`` and its inner optimizer with the named outer strategy on ``node``."""
    outer = create_strategy(
        strategy, model, collective=node.collective, groups=node.groups, config=config
    )
    return OuterOptimizer(inner, outer)


# -- a node in the user's process -----------------------------------------------------------

_TRAINER = "trainer"  # the member role the round coordinator takes its candidates from


class TrainingNode:
    """A running Lattica node with the data plane a user's loop syncs through."""

    def __init__(self, node: Any, state: Any, tensors: Any, coordinator: Any) -> None:
        self.node = node
        self.state = state
        self._tensors = tensors
        self._coordinator = coordinator

    @property
    def collective(self) -> Collective:
        return self._tensors  # type: ignore[no-any-return]

    @property
    def groups(self) -> GroupProvider:
        return self._coordinator  # type: ignore[no-any-return]

    @property
    def peer_id(self) -> str:
        return self.node.peer_id.to_base58()  # type: ignore[no-any-return]

    def addrs(self) -> list[str]:
        """Addresses other nodes can join through (``peers=`` of their ``NodeConfig``)."""
        return self.node.dialable_addrs()  # type: ignore[no-any-return]

    def trainers(self) -> list[str]:
        """The run's live members that train (this node included)."""
        members = self.state.snapshot().get("members", {})
        return [p for p in self.state.live_members() if members.get(p, {}).get("role") == _TRAINER]

    async def wait_for_members(self, count: int) -> None:
        """Return once ``count`` trainers (this node included) are live; wrap it in
        ``trio.fail_after`` for a deadline."""
        while len(self.trainers()) < count:
            with trio.move_on_after(1.0):
                await self.state.wait_changed()


class _DataPlane:
    """The node service behind ``TrainingNode``: tensors and round groups for the user's loop."""

    name = "data-plane"

    def __init__(self, context: NodeContext, state: Any, *, round_deadline_s: float, screen: ContributionScreen) -> None:
        from lattica.coordination.rounds import RoundCoordinator
        from lattica.net.tensors.transfer import TensorService, TensorServiceConfig

        self.state = state
        self.tensors = TensorService(context.host, context.key_pair, config=TensorServiceConfig(screen=screen))
        self.coordinator = RoundCoordinator(
            context.host, peer_id=context.peer_id.to_base58(), run_id=context.config.run_id,
            candidates=self._candidates, deadline_s=round_deadline_s,
        )

    def _candidates(self) -> list[str]:
        members = self.state.snapshot().get("members", {})
        return [p for p in self.state.live_members() if members.get(p, {}).get("role") == _TRAINER]

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.tensors.run)
            await nursery.start(self.coordinator.run)
            task_status.started()


@asynccontextmanager
async def open_node(
    config: NodeConfig,
    *,
    key_pair: KeyPair | None = None,
    round_deadline_s: float = 60.0,
    screen: ContributionScreen = DEFAULT_SCREEN,
) -> AsyncIterator[TrainingNode]:
    """Run a node for ``config`` (its ``train`` settings are not used: the loop is yours) until
    the block ends. The key is ``config.data_dir``'s identity unless ``key_pair`` is given; the
    run secret is read from ``config.secret_file``."""
    from lattica.daemon import DiscoveryService, StateService
    from lattica.net.access import read_secret_file
    from lattica.net.identity import load_or_create_identity
    from lattica.node import Node

    if key_pair is None:
        key_pair = load_or_create_identity(config.data_dir)
    secret = read_secret_file(config.secret_file) if config.secret_file is not None else None

    def services(context: NodeContext) -> list[NodeService]:
        state = StateService(context.host, context.key_pair, config, own_addrs=context.dialable_addrs,
                             metrics=context.metrics, role=_TRAINER)
        built: list[NodeService] = [state]
        if config.dht:
            built.append(DiscoveryService(context.host, run_id=config.run_id,
                                          connectivity=context.connectivity, metrics=context.metrics))
        built.append(_DataPlane(context, state.state, round_deadline_s=round_deadline_s, screen=screen))
        return built

    node = Node(config, key_pair, secret=secret, services=services)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        plane = next(s for s in node.services if isinstance(s, _DataPlane))
        try:
            yield TrainingNode(node, plane.state, plane.tensors, plane.coordinator)
        finally:
            node.request_shutdown()  # goodbyes, then Node.run returns and the nursery closes
