"""Assembling a daemon: the composition root of ``lattica join``.

``build_node`` gives the node one ``ServiceBuilder``, ``daemon_services``, which the node calls
once its host runs and bootstrap succeeded. It builds the run's services in dependency order —
the replicated state, the DHT, the NAT wiring, training and its metrics — passing each one what
it needs (the host, the state, the connectivity, the metrics) and nothing more, and returns them
in the order they start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from libp2p.crypto.keys import KeyPair

from lattica.config import NodeConfig
from lattica.node.discovery_service import DiscoveryService
from lattica.node.node import Node
from lattica.node.services import NodeContext, NodeService
from lattica.node.state_service import StateService
from lattica.node.training_metrics import TrainingMetricsExporter


def daemon_services(context: NodeContext) -> Sequence[NodeService]:
    """The services of ``lattica join``, built in dependency order from the running node."""
    config = context.config
    # a trainer is "joining" until its training service can sync (lattica.train.service)
    state = StateService(
        context.host, context.key_pair, config, own_addrs=context.dialable_addrs,
        metrics=context.metrics, role="joining" if config.train is not None else None,
    )
    services: list[NodeService] = [state]
    # peer exchange dials only the peers the replicated state verifies as members
    context.connectivity.follow_members(state.state.verified)
    discovery: DiscoveryService | None = None
    if config.dht:
        discovery = DiscoveryService(
            context.host, run_id=config.run_id, connectivity=context.connectivity, metrics=context.metrics,
        )
        services.append(discovery)
    traversal = context.connectivity.nat
    if traversal is not None:
        from lattica.node.nat_service import NatService, port_mapper_for

        services.append(NatService(
            traversal, host=context.host, peers=context.connectivity, state=state.state,
            metrics=context.metrics, dial_members=config.peer_exchange,
            port_mapper=port_mapper_for(config.listen) if config.upnp else None,
            on_reachability=discovery.set_reachability if discovery is not None else None,
        ))
    if config.train is not None:
        from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
        from lattica.train.service import TrainingService
        from lattica.train.settings.strategy_settings import contribution_screen

        # the tensor data plane: the Collective training syncs through, and where it serves its state
        screen = contribution_screen(config.train)
        tensors = TensorService(context.host, context.key_pair, config=TensorServiceConfig(screen=screen))
        training = TrainingService(context, state.state, config.train, tensors=tensors)
        services += [training, TrainingMetricsExporter(training, state.view, context.metrics)]
    return services


def build_node(
    config: NodeConfig, key_pair: KeyPair, *, secret: bytes | None = None,
    extra: Callable[[NodeContext], Sequence[NodeService]] | None = None,
) -> Node:
    """The daemon's node; ``extra`` builds services started after the daemon's own."""
    if config.train is not None:
        from lattica.train.service import check_settings

        check_settings(config.train)
    builder = daemon_services if extra is None else functools.partial(_with_extra, extra)
    return Node(config, key_pair, secret=secret, services=builder)


def _with_extra(extra: Callable[[NodeContext], Sequence[NodeService]], context: NodeContext) -> Sequence[NodeService]:
    return [*daemon_services(context), *extra(context)]

