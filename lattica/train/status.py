"""What the training service reports, typed: ``TrainingStatus``, and its JSON for ``lattica status``.

The training service builds a ``TrainingStatus`` on request (``TrainingService.statistics()``);
the node's metrics exporter reads its fields. ``as_json`` is the ``training`` section of
``lattica status`` and the answer to the ``train`` control request: the keys that do not apply
(no gossip averaging, no error, nothing refused) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lattica.train.engine.reports import Progress


@dataclass(frozen=True)
class ProgressFigures:
    """The trainer's last progress record, rounded as ``lattica status`` shows it."""

    step: int
    round: int
    loss: float
    tokens_per_s: float
    lr: float
    val_loss: float | None
    val_bpb: float | None = None  # validation bits per byte: comparable across tokenizers
    mfu: float | None = None  # model FLOPs utilisation (CUDA, a device of known peak, the built-in GPT)

    @classmethod
    def of(cls, progress: Progress, *, val_bpb: float | None = None) -> ProgressFigures:
        return cls(
            step=progress.step, round=progress.round, loss=round(progress.loss, 4),
            tokens_per_s=round(progress.tokens_per_s, 1), lr=progress.lr,
            val_loss=None if progress.val_loss is None else round(progress.val_loss, 4),
            val_bpb=None if val_bpb is None else round(val_bpb, 4),
            mfu=None if progress.mfu is None else round(progress.mfu, 4),
        )

    def as_json(self) -> dict[str, float | int | None]:
        info: dict[str, float | int | None] = {
            "step": self.step, "round": self.round, "loss": self.loss, "tokens_per_s": self.tokens_per_s,
            "lr": self.lr, "val_loss": self.val_loss,
        }
        if self.val_bpb is not None:
            info["val_bpb"] = self.val_bpb
        if self.mfu is not None:
            info["mfu"] = self.mfu
        return info


@dataclass(frozen=True)
class GossipFigures:
    """Gossip averaging's part: who this peer avoids, and how far the replicas spread."""

    avoided_partners: tuple[str, ...] = ()  # left out of this peer's group draws for now
    overlap: bool = False  # each round's exchange overlaps the next inner phase
    consensus_distance: float | None = None  # distance to the group's mean / its norm, 6 digits

    def as_json(self) -> dict[str, object]:
        info: dict[str, object] = {"averaging": "gossip"}
        if self.avoided_partners:
            info["avoided_partners"] = list(self.avoided_partners)
        if self.overlap:
            info["gossip_overlap"] = True
        if self.consensus_distance is not None:
            info["consensus_distance"] = self.consensus_distance
        return info


@dataclass(frozen=True, kw_only=True)
class TrainingStatus:
    phase: str  # starting, waiting for peers, loading, training, done, failed, ...
    strategy: str
    replicas_agree: bool
    rounds_target: int
    rounds_completed: int
    bytes_sent: int
    bytes_received: int  # tensor-plane bytes received (syncs and state fetches), counted on the wire
    device: str | None  # None until the trainer is built
    compiled: bool | None = None  # whether the forward pass runs compiled; None until the trainer is built
    progress: ProgressFigures | None = None  # None before the first progress record
    rejected_contributions: Mapping[str, int] = field(default_factory=dict)  # peer -> refused
    gossip: GossipFigures | None = None  # None unless the strategy averages in gossip groups
    error: str | None = None  # why training failed
    checkpoints_failing: str | None = None  # why checkpoints cannot be written now (retried)
    failed_members: tuple[str, ...] = ()  # live members whose training stopped on an error
    refused_states: Mapping[str, int] = field(default_factory=dict)  # members whose outer states failed the checks
    summary: Mapping[str, object] | None = None  # the run's summary, once it is done
    # the trainer's devices: ``devices`` (one entry per rank), and with several ranks
    # ``rank_restarts``, ``ranks_agree`` and ``rank_failures``
    devices: Mapping[str, object] = field(default_factory=dict)
    tuned: Mapping[str, object] | None = None  # ``tune = true``: the tuned schedule and what was not applied

    def as_json(self) -> dict[str, object]:
        info: dict[str, object] = {
            "phase": self.phase,
            "strategy": self.strategy,
            "replicas_agree": self.replicas_agree,
            "rounds_target": self.rounds_target,
            "rounds_completed": self.rounds_completed,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "device": self.device,
            "compiled": self.compiled,
            **self.devices,
        }
        if self.progress is not None:
            info.update(self.progress.as_json())
        if self.rejected_contributions:
            info["rejected_contributions"] = dict(sorted(self.rejected_contributions.items()))
        if self.gossip is not None:
            info.update(self.gossip.as_json())
        if self.error:
            info["error"] = self.error
        if self.checkpoints_failing:
            info["checkpoints"] = f"failing, retrying: {self.checkpoints_failing}"
        if self.failed_members:
            info["failed_members"] = sorted(self.failed_members)
        if self.refused_states:
            info["refused_states"] = dict(self.refused_states)
        if self.summary:
            info["summary"] = dict(self.summary)
        if self.tuned is not None:
            info["tuned"] = dict(self.tuned)
        return info
