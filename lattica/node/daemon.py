"""Assembling a daemon: the composition root of ``lattica join``.

``build_node`` gives the node one ``ServiceBuilder``, ``daemon_services``, which the node calls
once its host runs and bootstrap succeeded. It builds the run's services in dependency order —
the replicated state, the DHT, the NAT wiring, training and its metrics — passing each one what
it needs (the host, the state, the connectivity, the metrics) and nothing more, and returns them
in the order they start.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.peerinfo import PeerInfo
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.control.protocol import ControlRequest
from lattica.net.host import LatticaHost
from lattica.node.node import Node
from lattica.node.services import NodeContext, NodeService
from lattica.observability import NodeMetrics

if TYPE_CHECKING:
    from lattica.crdt.state import ReplicatedState
    from lattica.dht.discovery import RunDiscovery
    from lattica.net.connectivity import Connectivity
    from lattica.train.service import TrainingService

log = logging.getLogger(__name__)

_METRICS_INTERVAL_S = 2.0


class StateService:
    """The replicated run state as a daemon service: ``lattica state`` and membership."""

    name = "state"

    def __init__(
        self, host: LatticaHost, key_pair: KeyPair, config: NodeConfig, *,
        own_addrs: Callable[[], list[str]], metrics: NodeMetrics, role: str | None = None,
    ) -> None:
        from lattica.crdt import StateConfig
        from lattica.crdt.liveness import VouchPolicy
        from lattica.crdt.state import ReplicatedState

        self.role = role
        self._own_addrs = own_addrs
        self._metrics = metrics
        self.state = ReplicatedState(
            host, key_pair, data_dir=config.data_dir, run_id=config.run_id,
            config=StateConfig(
                admins=config.admins,
                anchors=() if config.admins else bootstrap_ids(config.peers),
                vouching=VouchPolicy(admins_only=bool(config.admins)),  # named admins: only they admit
            ),
        )
        self._found_run = not config.admins  # a founder writes the run config's genesis

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.state.run)
            # a restarted node's record still holds the role of its previous life: replace it
            # with the first write, before the training service gets to it
            if self.role is not None:
                await self.state.update_member(addrs=self._own_addrs(), role=self.role)
            else:
                await self.state.update_member(addrs=self._own_addrs())
            await self._write_genesis()
            task_status.started()
            nursery.start_soon(self._export_metrics)

    async def _write_genesis(self) -> None:
        """The founder of a run (admin by default: it joined through nobody) writes the run
        config's first record, naming itself: its authority is then in every member's state,
        and in its own log across restarts, with or without ``--peer``."""
        state = self.state
        if self._found_run and state.peer_id in state.admins and not state.snapshot()["config"]:
            await state.set_run_config({FOUNDER_KEY: state.peer_id})

    async def _export_metrics(self) -> None:
        while True:
            log_bytes = self.state.counters().get("log_bytes", 0)
            self._metrics.replicated_state_bytes.set(log_bytes if isinstance(log_bytes, int) else 0)
            await trio.sleep(_METRICS_INTERVAL_S)

    async def on_shutdown(self) -> None:
        await self.state.leave()

    def status(self) -> dict[str, object]:
        status: dict[str, object] = {"live_members": len(self.state.live_members()), **_scalars(self.state.counters())}
        if self.state.log_failing:  # the node runs on; the log is written once space returns
            status["log"] = f"failing, records held in memory, retrying: {self.state.log_failing}"
        return {"state": status}

    async def handle_control(self, request: ControlRequest) -> object | None:
        if request.method == "state":
            return self.state.dump()
        return None


class DiscoveryService:
    """The Kademlia DHT: run discovery (``/lattica/run/<id>``) and content routing."""

    name = "dht"

    def __init__(self, host: LatticaHost, *, run_id: str, connectivity: Connectivity, metrics: NodeMetrics) -> None:
        from lattica.dht.config import DHTConfig
        from lattica.dht.discovery import RunDiscovery

        async def connect(info: PeerInfo) -> bool:
            return await connectivity.dial_peer(info.peer_id.to_base58(), [str(a) for a in info.addrs])

        self._metrics = metrics
        self.discovery: RunDiscovery = RunDiscovery(host, run_id=run_id, config=DHTConfig(), connect=connect)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # bootstrapping and the first lookups take network round trips: do not hold start-up
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.discovery.run)
            nursery.start_soon(self._export_metrics)

    async def _export_metrics(self) -> None:
        previous = None
        while True:
            self._metrics.dht_routing_table_peers.set(self.discovery.routing_table_size())
            stats = self.discovery.dht.store_stats()
            self._metrics.set_dht_store(stats, previous=previous)
            previous = stats
            await trio.sleep(_METRICS_INTERVAL_S)

    async def set_reachability(self, public: bool) -> None:
        await self.discovery.set_reachability(public)

    def status(self) -> dict[str, object]:
        return {"dht": self.discovery.status()}


class TrainingMetricsExporter:
    """Copies the training service's progress into the node's Prometheus metrics."""

    name = "training-metrics"

    def __init__(self, training: TrainingService, state: ReplicatedState, metrics: NodeMetrics) -> None:
        self.training, self.state, self.metrics = training, state, metrics

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        metrics = self.metrics
        task_status.started()
        last_round, last_round_at, last_step, last_step_at = 0, trio.current_time(), 0, trio.current_time()
        accounted: dict[str, int] = {}
        rejected = 0
        while True:
            info = self.training.status()["training"]
            now = trio.current_time()
            rounds = int(info.get("rounds_completed") or 0)
            if rounds > last_round:
                metrics.rounds_completed.inc(rounds - last_round)
                metrics.round_seconds.observe((now - last_round_at) / (rounds - last_round))
                last_round, last_round_at = rounds, now
            metrics.outer_round.set(rounds)
            step = int(info.get("step") or 0)
            if step > last_step:
                metrics.inner_steps_per_second.set((step - last_step) / max(now - last_step_at, 1e-9))
                last_step, last_step_at = step, now
            for name, gauge in (("loss", metrics.train_loss), ("val_loss", metrics.validation_loss),
                                ("tokens_per_s", metrics.tokens_per_second),
                                ("consensus_distance", metrics.consensus_distance)):
                if info.get(name) is not None:
                    gauge.set(info[name])
            refused = sum((info.get("rejected_contributions") or {}).values())
            metrics.rejected_contributions.inc(max(0, refused - rejected))
            rejected = max(rejected, refused)
            metrics.avoided_partners.set(len(info.get("avoided_partners") or ()))
            progress = self.state.snapshot().get("progress", {})
            newest = max((r for p in progress.values() if isinstance(r := p.get("round"), int)), default=0)
            metrics.staleness_rounds.set(max(0, newest - rounds))
            figures = self.training.accounting()
            if figures:
                metrics.set_accounting(figures, previous=accounted)
                accounted = figures
            await trio.sleep(1.0)


FOUNDER_KEY = "founder"  # the run config's genesis: {"founder": <peer id>}


def bootstrap_ids(peers: Sequence[str]) -> tuple[str, ...]:
    """The peer ids of ``--peer`` addresses (a relay address names the peer at its end)."""
    return tuple(dict.fromkeys(p.rsplit("/p2p/", 1)[-1] for p in peers))


def _scalars(values: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in values.items() if isinstance(v, int | float | str)}


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
        from lattica.train.strategy_settings import contribution_screen

        # the tensor data plane: the Collective training syncs through, and where it serves its state
        screen = contribution_screen(config.train)
        tensors = TensorService(context.host, context.key_pair, config=TensorServiceConfig(screen=screen))
        training = TrainingService(context, state.state, config.train, tensors=tensors)
        services += [training, TrainingMetricsExporter(training, state.state, context.metrics)]
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


# -- running a daemon process ------------------------------------------------------------------
#
# ``lattica stop``, SIGTERM and SIGINT promise that the process is gone within
# SHUTDOWN_DEADLINE_S of the request. Node.run spends at most 3.5 s on goodbyes (services, then
# peers), then cancels its services; a service inside ``trio.to_thread.run_sync`` (an inner step
# of a large model, a checkpoint fsync) or in CPU work on the trio thread (the outer step of a
# large model) delays that cancellation, so a watchdog ends the process at the deadline
# whatever is still running. Checkpoints and the state log are written atomically, so an exit
# at any point leaves them intact. Finally, Python's own teardown collects every object left
# (the libp2p and torch object graphs: 3-5 s measured): ``run_until_stopped`` freezes them
# first, as the process ends right after.

SHUTDOWN_DEADLINE_S = 4.0


def run_until_stopped(
    config: NodeConfig, key_pair: KeyPair, *, secret: bytes | None = None,
    on_started: Callable[[Node], None] = lambda node: None,
) -> int:
    """``lattica join`` in this process: run the daemon until it is stopped; the exit code."""

    async def main() -> None:
        await serve(build_node(config, key_pair, secret=secret), on_started=on_started)

    trio.run(main)
    gc.freeze()  # nothing is collected any more: the interpreter exits next
    return 0


async def serve(node: Node, *, on_started: Callable[[Node], None] = lambda node: None) -> None:
    """Run ``node`` until ``lattica stop``, SIGTERM or SIGINT; return once it is down.

    The first signal (or the control request) starts the graceful shutdown of ``Node.run``; a
    second signal cancels at once. Either way this returns when ``Node.run`` has returned, or
    the process ends at ``SHUTDOWN_DEADLINE_S`` after the request.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, signals, node, nursery.cancel_scope)
            nursery.start_soon(_exit_when_overdue, node)
            await nursery.start(_run_node, node, nursery.cancel_scope)
            on_started(node)


async def _run_node(node: Node, scope: trio.CancelScope, *, task_status: TaskStatus[Node]) -> None:
    try:
        await node.run(task_status=task_status)
    finally:
        scope.cancel()  # the signal watcher and the watchdog must not outlive the node


async def _stop_on_signals(signals: AsyncIterator[int], node: Node, scope: trio.CancelScope) -> None:
    async for _ in signals:
        if node.host is None or node.shutdown_requested:  # still starting, or asked twice
            scope.cancel()
            return
        node.request_shutdown()


async def _exit_when_overdue(node: Node) -> None:
    await node.wait_for_shutdown_request()
    await trio.sleep(SHUTDOWN_DEADLINE_S)
    log.warning("the daemon's services did not stop within %g s; exiting now", SHUTDOWN_DEADLINE_S)
    with contextlib.suppress(OSError):
        os.unlink(node.config.control_socket)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
