"""The training service's progress, copied into the node's Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from trio_typing import TaskStatus

from lattica.observability import NodeMetrics

if TYPE_CHECKING:
    from lattica.train.membership import MembershipView
    from lattica.train.service import TrainingService


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
            metrics.staleness_rounds.set(max(0, self.members.newest_published_round() - rounds))
            figures = self.training.accounting()
            if figures:
                metrics.set_accounting(figures, previous=accounted)
                accounted = figures
            await trio.sleep(1.0)

