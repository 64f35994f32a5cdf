"""From the run settings to a ready ``Trainer``: the task, the model, the outer strategy.

The daemon's training service decides *when* to build (after the run config is agreed) and
what to wrap the strategy in; this module decides *what* is built:

- the task: a user's ``package.module:function`` (``train.task``), or the built-in language
  model on the configured data, with the same model seed everywhere (identical initial weights)
  and a data seed per peer (different data order);
- a strategy that ``trains_experts`` (SPES) trains a mixture-of-experts model instead of the
  dense preset, with the expert ownership the service keeps in the replicated state;
- the strategy from its registered class and the config ``strategy_settings`` maps the run
  settings onto, talking to the network only through the ``Collective`` and ``GroupProvider``
  it is given, and judging what partners send with the run's ``max_norm_ratio``
  (``numerics.partner_screen``; refusals go to ``on_refused``);
- the trainer's schedule: ``rounds × inner_steps`` steps, warm-up, a validation every round;
  and how its inner loop runs on this node's hardware (``compile``, ``micro_batches``,
  ``activation_checkpointing``). The model is on the training device before the strategy is
  built, so the strategy places its outer state for that device (``outer_placement``);
- with several devices (``train.devices``) a ``RankedTrainer``: the model stays on the CPU as
  the node's replica and one rank process per device trains it (``train/ranks``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lattica.config import TrainSettings
from lattica.coordination.provider import GroupProvider
from lattica.numerics.partner_screen import PartnerScreen
from lattica.numerics.screen import Rejection
from lattica.train.engine.checkpoint import CheckpointStore
from lattica.train.engine.collective import Collective
from lattica.train.engine.data import DataConfig
from lattica.train.engine.device import select_device
from lattica.train.engine.moe import MOE_PRESETS, build_moe_model
from lattica.train.engine.ranks.trainer import RankedTrainer, RankSetup
from lattica.train.engine.reports import Progress, RoundCompleted
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task, TaskContext, builtin_task, load_task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.settings.rank_settings import check_rank_settings
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import strategy_class
from lattica.train.strategies.base import OuterStrategy, StrategyHandles
from lattica.train.strategies.experts import ExpertOwnership


@dataclass(frozen=True, kw_only=True)
class TrainerParts:
    """What a trainer is built from besides the settings."""

    peer_id: str
    collective: Collective
    groups: GroupProvider
    checkpoint_dir: Path
    members: tuple[str, ...] = ()  # SPES without an ownership source: the initial expert owners
    ownership: ExpertOwnership | None = None
    on_progress: Callable[[Progress], None] | None = None
    on_round: Callable[[RoundCompleted], None] | None = None
    on_refused: Callable[[Rejection], None] | None = None  # a partner's contribution was refused


def averages_in_groups(settings: TrainSettings) -> bool:
    """Whether the strategy of ``settings`` syncs in coordinator-free groups (NoLoCo, DiLoCo
    with ``averaging = "gossip"``): then the service starts ``GossipGroups`` for it."""
    return strategy_class(settings.strategy).averages_in_groups(strategy_config(settings))


def trains_experts(settings: TrainSettings) -> bool:
    """Whether each member trains its own experts of a built-in MoE model (SPES without a
    user task): then the service keeps expert ownership in the replicated state."""
    return strategy_class(settings.strategy).trains_experts and not settings.task


def expert_count(settings: TrainSettings) -> int:
    return MOE_PRESETS[moe_preset(settings.model)].num_experts


def build_trainer(
    settings: TrainSettings,
    parts: TrainerParts,
    *,
    wrap: Callable[[OuterStrategy[object]], OuterStrategy[object]] = lambda s: s,
) -> Trainer:
    """The trainer of ``settings``; ``wrap`` may put the strategy inside another one that
    implements the same interface (the daemon's outer-state sync). Blocking: model building
    and data loading, so call it in a worker thread."""
    s = settings
    node = check_rank_settings(s)
    device = select_device(node.single if node.ranks == 1 else "cpu")  # several: the replica stays on the CPU
    task = build_task(s, peer_id=parts.peer_id)
    task.model.to(device.device)
    handles = StrategyHandles(
        ownership=parts.ownership, partner_screen=PartnerScreen(s.max_norm_ratio, on_refused=parts.on_refused),
    )
    strategy = strategy_class(s.strategy).build(
        task.model, collective=parts.collective, groups=parts.groups,
        config=strategy_config(s, members=parts.members), handles=handles,
    )
    total = s.rounds * s.inner_steps
    trainer_config = TrainerConfig(
        total_steps=total,
        schedule=ScheduleConfig(lr=s.inner_lr, warmup_steps=min(s.warmup_steps, total - 1), total_steps=total),
        eval_every=s.inner_steps,
        log_every=max(1, min(10, s.inner_steps // 2)),
        compile=s.compile,
        micro_batches=s.micro_batches,
        activation_checkpointing=s.activation_checkpointing,
    )
    checkpoints = CheckpointStore(parts.checkpoint_dir, keep=s.keep_checkpoints)
    trainer: Trainer
    if node.ranks > 1:  # one rank process per device, the replica in the daemon (``train/engine/ranks``)
        ranks = RankSetup(devices=node, settings=s, peer_id=parts.peer_id, task_builder=TASK_BUILDER)
        trainer = RankedTrainer(
            task, wrap(strategy), trainer_config, ranks=ranks,
            checkpoints=checkpoints, on_progress=parts.on_progress, on_round=parts.on_round,
        )
    else:
        trainer = Trainer(
            task, wrap(strategy), trainer_config, device=device, checkpoints=checkpoints,
            on_progress=parts.on_progress, on_round=parts.on_round,
        )
    trainer.annotations.update(export_annotations(task))
    return trainer


def run_identity(task: Task) -> dict[str, str]:
    """The hashes the run agrees on (``run_config.agree_run_identity``): the model's, and a
    prepared corpus's manifest (a byte-level corpus stays each member's own)."""
    return {"model_hash": task.model_hash, "data_hash": task.data_hash if task.tokenizer is not None else ""}


def export_annotations(task: Task) -> dict[str, object]:
    """What ``lattica export`` needs beside the weights, kept with every checkpoint: the model's
    description and the tokenizer of the data."""
    annotations: dict[str, object] = {}
    if task.model_description is not None:
        annotations["model"] = task.model_description
    if task.tokenizer is not None:
        annotations["tokenizer"] = str(task.tokenizer.resolve())
    return annotations

# how a rank's worker process builds the same task (``engine/ranks/worker.py`` imports it by name)
TASK_BUILDER = f"{__name__}:build_task"


def build_task(settings: TrainSettings, *, peer_id: str) -> Task:
    """The user's task or the built-in one (module docstring)."""
    s = settings
    # identical initial weights everywhere (model seed), different data order per peer
    context = TaskContext(seed=s.seed * 1_000_003 + zlib.crc32(peer_id.encode()))
    if s.task:
        return load_task(s.task, context)
    # the shards' sha256s were checked at start-up (``settings_check``): here sizes only
    task = builtin_task(
        model=s.model, data=DataConfig(source=s.data, verify=False), batch_size=s.batch_size,
        context=context, model_seed=s.seed, seq_len=s.seq_len, init=s.init,
    )
    if strategy_class(s.strategy).trains_experts:
        task.model = build_moe_model(moe_preset(s.model), seed=s.seed)
        task.model_description = None  # not the dense preset's: export knows no MoE model
    return task


def moe_preset(model: str) -> str:
    return model if model in MOE_PRESETS else "tiny-moe"
