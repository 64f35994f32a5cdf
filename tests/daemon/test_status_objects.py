"""Typed status objects: what each service reports, its JSON for ``lattica status``, and the
training metrics exporter reading the fields (the JSON shape itself is checked against real
daemons by the daemon, NAT and reliability tests)."""

from __future__ import annotations

import trio

from lattica.node.state_service import StateStatus
from lattica.node.training_metrics import TrainingMetricsExporter
from lattica.observability import NodeMetrics
from lattica.train.status import GossipFigures, ProgressFigures, TrainingStatus

BASE = {
    "phase": "training", "strategy": "diloco", "replicas_agree": True, "rounds_target": 10,
    "rounds_completed": 2, "bytes_sent": 100, "bytes_received": 200, "device": "cpu (fp32)",
    "compiled": False,
}


def test_a_training_status_shows_only_what_applies() -> None:
    assert TrainingStatus(**BASE).as_json() == BASE  # type: ignore[arg-type]


def test_a_training_status_shows_every_part_in_the_order_of_lattica_status() -> None:
    status = TrainingStatus(
        **BASE,  # type: ignore[arg-type]
        progress=ProgressFigures(
            step=40, round=2, loss=2.5, tokens_per_s=1000.0, lr=0.001, val_loss=2.0, val_bpb=1.25, mfu=0.4,
        ),
        rejected_contributions={"b": 1, "a": 2},
        gossip=GossipFigures(avoided_partners=("c",), overlap=True, consensus_distance=0.125),
        error="boom", checkpoints_failing="disk full", failed_members=("z", "y"),
        refused_states={"x": 1}, summary={"val_loss": 1.5},
    )
    info = status.as_json()
    assert list(info) == [
        *BASE, "step", "round", "loss", "tokens_per_s", "lr", "val_loss", "val_bpb", "mfu", "rejected_contributions",
        "averaging", "avoided_partners", "gossip_overlap", "consensus_distance", "error", "checkpoints",
        "failed_members", "refused_states", "summary",
    ]
    assert info["rejected_contributions"] == {"a": 2, "b": 1}
    assert (info["averaging"], info["avoided_partners"]) == ("gossip", ["c"])
    assert info["checkpoints"] == "failing, retrying: disk full"
    assert info["failed_members"] == ["y", "z"]


def test_the_state_status_keeps_the_scalar_counters_and_says_when_the_log_fails() -> None:
    counters = {"updates_accepted": 3, "updates_rejected": {"bad-signature": 1}, "state_bytes": 10, "log_bytes": 7}
    fine = StateStatus.of(2, counters, log_failing=None).as_json()
    assert (fine["live_members"], fine["updates_accepted"], fine["log_bytes"]) == (2, 3, 7)
    assert "updates_rejected" not in fine
    assert "log" not in fine
    failing = StateStatus.of(2, counters, log_failing="No space left on device").as_json()
    assert failing["log"] == "failing, records held in memory, retrying: No space left on device"


class _Training:
    def __init__(self, statuses: list[TrainingStatus]) -> None:
        self.statuses = statuses

    def statistics(self) -> TrainingStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def accounting(self) -> dict[str, int]:
        return {}


class _Members:
    def newest_published_round(self) -> int:
        return 5


async def test_the_training_metrics_exporter_reads_the_status_fields(autojump_clock) -> None:
    first = TrainingStatus(**BASE, rejected_contributions={"p": 2})  # type: ignore[arg-type]
    later = TrainingStatus(
        **{**BASE, "rounds_completed": 3},  # type: ignore[arg-type]
        progress=ProgressFigures(step=60, round=3, loss=2.25, tokens_per_s=500.0, lr=0.001, val_loss=2.5, mfu=0.25),
        rejected_contributions={"p": 3, "q": 1},
        gossip=GossipFigures(avoided_partners=("q",), consensus_distance=0.5),
    )
    metrics = NodeMetrics(process=False)
    exporter = TrainingMetricsExporter(_Training([first, later]), _Members(), metrics)  # type: ignore[arg-type]
    with trio.move_on_after(2.5):
        await exporter.run()
    value = metrics.registry.get_sample_value
    assert value("lattica_outer_round") == 3
    assert value("lattica_rounds_completed_total") == 3
    assert (value("lattica_train_loss"), value("lattica_validation_loss")) == (2.25, 2.5)
    assert (value("lattica_tokens_per_second"), value("lattica_consensus_distance")) == (500.0, 0.5)
    assert value("lattica_model_flops_utilization") == 0.25
    assert value("lattica_rejected_contributions_total") == 4
    assert value("lattica_avoided_partners") == 1
    assert value("lattica_staleness_rounds") == 2
