"""A Lattica node inside a training script that owns its loop (``open_node``).

    config = NodeConfig(data_dir=Path("node"), listen=("/ip4/0.0.0.0/tcp/4001",), peers=(...))
    async with open_node(config) as node:          # a Lattica node in this process
        await node.wait_for_members(2)              # optional: start with the others
        outer = wrap(model, inner, node=node, strategy="diloco")   # lattica.train.api

``open_node`` runs the node of ``lattica join`` (libp2p host, access control, control socket,
bootstrap, peer exchange, the replicated run state, the DHT where enabled) plus the training
data plane and the round coordinator, and hands out what ``lattica.train.api.wrap`` needs:
``.collective`` and ``.groups``. The round candidates are the run's live members that
registered as trainers, so scripts on several machines (or ``lattica join --train`` daemons of
the same strategy) train together. It is composition (it builds node services), so it lives
beside ``daemon.py``, not in ``lattica.train``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.crypto.keys import KeyPair
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.coordination.provider import GroupProvider
from lattica.coordination.rounds import RoundCoordinator
from lattica.crdt.state import ReplicatedState
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.node.node import Node
from lattica.node.services import NodeContext, NodeService
from lattica.numerics.screen import DEFAULT_SCREEN, ContributionScreen
from lattica.train.engine.collective import Collective
from lattica.train.swarm.membership import TRAINER_ROLE, MembershipView


class TrainingNode:
    """A running Lattica node with the data plane a user's loop syncs through."""

    def __init__(self, node: Node, view: MembershipView, tensors: TensorService, coordinator: RoundCoordinator) -> None:
        self.node = node
        self.view = view
        self._tensors = tensors
        self._coordinator = coordinator

    @property
    def collective(self) -> Collective:
        return self._tensors

    @property
    def groups(self) -> GroupProvider:
        return self._coordinator

    @property
    def peer_id(self) -> str:
        return self.view.peer_id

    def addrs(self) -> list[str]:
        """Addresses other nodes can join through (``peers=`` of their ``NodeConfig``)."""
        return self.node.dialable_addrs()

    def trainers(self) -> list[str]:
        """The run's live members that train (this node included)."""
        return self.view.trainers()

    async def wait_for_members(self, count: int) -> None:
        """Return once ``count`` trainers (this node included) are live; wrap it in
        ``trio.fail_after`` for a deadline."""
        while len(self.trainers()) < count:
            with trio.move_on_after(1.0):
                await self.view.wait_changed()


class _DataPlane:
    """The node service behind ``TrainingNode``: tensors and round groups for the user's loop."""

    name = "data-plane"

    def __init__(
        self, context: NodeContext, state: ReplicatedState, *, round_deadline_s: float, screen: ContributionScreen,
    ) -> None:
        self.view = MembershipView(state, peer_id=context.peer_id.to_base58())
        self.tensors = TensorService(context.host, context.key_pair, config=TensorServiceConfig(screen=screen))
        self.coordinator = RoundCoordinator(
            context.host, peer_id=self.view.peer_id, run_id=context.config.run_id,
            candidates=self.view.trainers, deadline_s=round_deadline_s,
        )

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
    from lattica.net.access import read_secret_file
    from lattica.net.identity import load_or_create_identity
    from lattica.node.discovery_service import DiscoveryService
    from lattica.node.state_service import StateService

    if key_pair is None:
        key_pair = load_or_create_identity(config.data_dir)
    secret = read_secret_file(config.secret_file) if config.secret_file is not None else None

    def services(context: NodeContext) -> list[NodeService]:
        state = StateService(context.host, context.key_pair, config, own_addrs=context.dialable_addrs,
                             metrics=context.metrics, role=TRAINER_ROLE)
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
            yield TrainingNode(node, plane.view, plane.tensors, plane.coordinator)
        finally:
            node.request_shutdown()  # goodbyes, then Node.run returns and the nursery closes
