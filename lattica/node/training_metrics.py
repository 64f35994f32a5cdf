"""The training service's progress, copied into the node's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio
from prometheus_client import Gauge
from trio_typing import TaskStatus

from lattica.observability import NodeMetrics

if TYPE_CHECKING:
    from lattica.train.service import TrainingService
    from lattica.train.swarm.membership import MembershipView


class TrainingMetricsExporter:
    """Copies the training service's progress into the node's Prometheus metrics."""

    name = "training-metrics"

    def __init__(self, training: TrainingService, members: MembershipView, metrics: NodeMetrics) -> None:
        self.training, self.members, self.metrics = training, members, metrics

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        metrics = self.metrics
        task_status.started()
        last_round, last_round_at, last_step, last_step_at = 0, trio.current_time(), 0, trio.current_time()
        accounted: dict[str, int] = {}
        rejected = 0
        while True:
            status = self.training.statistics()
            now = trio.current_time()
            rounds = status.rounds_completed
            if rounds > last_round:
                metrics.rounds_completed.inc(rounds - last_round)
                metrics.round_seconds.observe((now - last_round_at) / (rounds - last_round))
                last_round, last_round_at = rounds, now
            metrics.outer_round.set(rounds)
            progress, gossip = status.progress, status.gossip
            step = progress.step if progress is not None else 0
            if step > last_step:
                metrics.inner_steps_per_second.set((step - last_step) / max(now - last_step_at, 1e-9))
                last_step, last_step_at = step, now
            if progress is not None:
                _set_known(((metrics.train_loss, progress.loss), (metrics.validation_loss, progress.val_loss),
                            (metrics.tokens_per_second, progress.tokens_per_s), (metrics.mfu, progress.mfu)))
            if gossip is not None:
                _set_known(((metrics.consensus_distance, gossip.consensus_distance),))
            devices = status.devices.get("devices")
            metrics.set_devices([d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else [])
            refused = sum(status.rejected_contributions.values())
            metrics.rejected_contributions.inc(max(0, refused - rejected))
            rejected = max(rejected, refused)
            metrics.avoided_partners.set(len(gossip.avoided_partners) if gossip is not None else 0)
            metrics.set_staleness(own_round=rounds, max_seen_round=self.members.newest_published_round())
            figures = self.training.accounting()
            if figures:
                metrics.set_accounting(figures, previous=accounted)
                accounted = figures
            await trio.sleep(1.0)


def _set_known(values: Iterable[tuple[Gauge, float | None]]) -> None:
    """Set each gauge whose figure is known; an unknown one keeps its last value."""
    for gauge, value in values:
        if value is not None:
            gauge.set(value)
