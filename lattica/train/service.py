"""Training inside the daemon: the trainer, the data plane and the run state wired together.

Theory of operation: ``TrainingService.run`` starts the tensor data plane and the round
coordinator, then (in the background) waits until ``min_peers`` members are live, builds the
task and the outer strategy, and either resumes from its own last checkpoint or — when the run
is already past round 0 — fetches the agreed outer state from several holders (hash-verified)
and trains from the next round. After each completed round it publishes ``(round, weights
hash)`` in the replicated state and serves its outer state for joiners. A peer whose round ran
without the others (it was late, or the all-reduce failed) catches up the same way a joiner
does, before its next inner step, so replicas re-converge to bit-identical outer weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from typing import Any

import trio

from lattica.config import TrainSettings
from lattica.errors import ConfigError, LatticaError

log = logging.getLogger(__name__)

_CATCH_UP_WAIT_S = 5.0
_JOIN_ATTEMPTS = 3
_REPAIR_RETRY_S = 2.0


class TrainingService:
    def __init__(self, node: Any, state: Any, settings: TrainSettings) -> None:
        self.node = node
        self.state = state
        self.settings = settings
        self.peer_id = node.peer_id.to_base58()
        self.phase = "starting"
        self.progress: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None
        self.tensors: Any = None
        self.trainer: Any = None
        self.strategy: Any = None
        self._nursery: trio.Nursery | None = None
        self._bytes_sent = 0
        self._rounds_done = 0
        self._mine: tuple[int, str | None] = (0, None)  # completed rounds, outer weights hash
        self._next_repair_at = 0.0

    # -- service -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
        from lattica.train.rounds import RoundCoordinator

        host = self.node.host
        self.tensors = TensorService(host, self.node.key_pair, config=TensorServiceConfig())
        self.coordinator = RoundCoordinator(
            host,
            peer_id=self.peer_id,
            run_id=self.node.config.run_id,
            candidates=self._candidates,
            deadline_s=self.settings.round_deadline_s,
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.tensors.run)
            await nursery.start(self.coordinator.run)
            task_status.started()
            nursery.start_soon(self._train_guarded)

    def _candidates(self) -> list[str]:
        snapshot = self.state.snapshot()
        members = snapshot.get("members", {})
        return [p for p in self.state.live_members() if members.get(p, {}).get("role") == "trainer"]

    async def _train_guarded(self) -> None:
        try:
            await self._train()
        except LatticaError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)
        except ValueError as exc:
            self.phase, self.error = "failed", str(exc)
            log.error("training stopped: %s", exc)
        except Exception as exc:  # a training bug must not take the node off the network
            self.phase, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("training failed")

    async def _train(self) -> None:
        self.phase = "waiting for peers"
        await self.state.update_member(role="trainer")
        while len(self._candidates()) < self.settings.min_peers:
            with trio.move_on_after(1.0):
                await self.state.wait_changed()
        self.phase = "loading"
        trainer = await trio.to_thread.run_sync(self._build_trainer)
        self.trainer = trainer
        await self.state.update_member(device=trainer.device.describe())
        if await trio.to_thread.run_sync(trainer.resume):
            self._mine = (self.strategy.completed_rounds, self._outer_hash())
        # a fresh peer, or one restarted from a checkpoint the swarm has moved past, takes the
        # swarm's outer state; otherwise it trains on from its own checkpoint
        if self.strategy.replicas_agree:
            # a joiner, or a peer restarted from a stale checkpoint, takes the swarm's state;
            # strategies whose replicas differ by design (NoLoCo, eager) start from their own
            await self._join_running_swarm()
            self._wrap_strategy_for_catch_up()
        self.phase = "training"
        summary = await trainer.run()
        self.summary = dataclasses.asdict(summary)
        self.phase = "done"
        log.info("training finished: %s", self.summary)

    def _build_trainer(self) -> Any:
        from lattica.train.checkpoint import CheckpointStore
        from lattica.train.data import DataConfig
        from lattica.train.device import select_device
        from lattica.train.schedule import ScheduleConfig
        from lattica.train.strategies import create_strategy, strategy_class
        from lattica.train.task import TaskContext, builtin_task, load_task
        from lattica.train.trainer import Trainer, TrainerConfig

        s = self.settings
        # identical initial weights everywhere (model seed), different data order per peer
        data_seed = s.seed * 1_000_003 + zlib.crc32(self.peer_id.encode())
        context = TaskContext(seed=data_seed)
        if s.task:
            task = load_task(s.task, context)
        else:
            task = builtin_task(
                model=_model_config(s), data=DataConfig(source=s.data), batch_size=s.batch_size,
                context=context, model_seed=s.seed,
            )
        if s.strategy == "spes" and not s.task:
            from lattica.train.moe import build_moe_model

            task.model = build_moe_model(_moe_preset(s.model), seed=s.seed)
        strategy = create_strategy(
            s.strategy, task.model, collective=self.tensors, groups=self.coordinator,
            config=self._strategy_config(strategy_class(s.strategy)),
        )
        self.strategy = strategy
        total = s.rounds * s.inner_steps
        trainer_config = TrainerConfig(
            total_steps=total,
            schedule=ScheduleConfig(lr=s.inner_lr, warmup_steps=min(s.warmup_steps, total - 1), total_steps=total),
            eval_every=s.inner_steps,
            log_every=max(1, min(10, s.inner_steps // 2)),
        )
        return Trainer(
            task, strategy, trainer_config,
            device=select_device(s.device),
            checkpoints=CheckpointStore(self.node.config.data_dir / "checkpoints", keep=s.keep_checkpoints),
            on_progress=self._on_progress,
            on_round=self._on_round,
        )

    def _strategy_config(self, cls: Any) -> Any:
        """The strategy's config from the run settings; unset values keep its own defaults."""
        config_cls = getattr(cls, "config_class", None)
        if config_cls is None:
            return None
        s = self.settings
        wanted: dict[str, Any] = {
            "inner_steps": s.inner_steps,
            "sync_every": s.inner_steps,  # SPES: dense average + expert copy every S steps
            "merge_every": s.inner_steps * max(1, round(500 / s.inner_steps)),  # SPES warm-up: ~500 steps
            "outer_lr": s.outer_lr,
            "outer_momentum": s.outer_momentum,
            "members": tuple(sorted(self._candidates())),  # SPES: initial expert owners
        }
        names = {f.name for f in dataclasses.fields(config_cls)}
        return config_cls(**{k: v for k, v in wanted.items() if k in names and v is not None})

    # -- joining and catching up ---------------------------------------------------------------

    async def _join_running_swarm(self) -> bool:
        # the holders move on every round and a fetch that straddles one fails its hash check:
        # look at the state again and retry
        for _ in range(_JOIN_ATTEMPTS):
            agreed = self._agreed()
            if agreed is None or agreed[0] <= self.strategy.completed_rounds:
                return False
            self.phase = "fetching outer state"
            if await self._adopt(agreed):
                await self._publish_round()  # a holder now, and counted at that round
                return True
        return False

    def _agreed(self) -> tuple[int, str, list[str]] | None:
        from lattica.train.outer_transfer import agreed_round

        return agreed_round(self.state.snapshot().get("progress", {}), self.state.live_members(), self.peer_id)

    async def _adopt(self, agreed: tuple[int, str, list[str]]) -> bool:
        from lattica.train.join import fetch_outer_state, unflatten_outer_state

        rnd, digest, holders = agreed
        started = time.monotonic()
        try:
            with trio.fail_after(max(30.0, self.settings.round_deadline_s)):
                flat = await fetch_outer_state(holders, self.tensors.fetch, expected_hash=digest)
            outer = unflatten_outer_state(flat)
        except (LatticaError, trio.TooSlowError) as exc:
            log.warning("could not fetch outer state of round %d: %s", rnd, exc)
            return False
        self.trainer.adopt_outer_state(outer, step=int(outer.get("step", rnd * self.settings.inner_steps)))
        self._observe("checkpoint_fetch_seconds", time.monotonic() - started)
        self._mine = (self.strategy.completed_rounds, digest)
        log.info(
            "adopted outer state of round %d from %d holder(s) in %.2f s",
            rnd, len(holders), time.monotonic() - started,
        )
        return True

    def _wrap_strategy_for_catch_up(self) -> None:
        strategy = self.strategy
        original = strategy.after_inner_step

        async def after_inner_step(step: int) -> list[Any]:
            reports = await original(step)
            for report in reports:
                if report.skipped or self._ran_alone(report):
                    await self._catch_up(report)
            await self._repair_if_diverged()
            return reports

        strategy.after_inner_step = after_inner_step  # type: ignore[method-assign]

    def _ran_alone(self, report: Any) -> bool:
        return not report.skipped and len(report.group) <= 1 and len(self._candidates()) > 1

    async def _catch_up(self, report: Any) -> None:
        with trio.move_on_after(_CATCH_UP_WAIT_S):
            while True:
                agreed = self._agreed()
                if agreed is not None and agreed[0] >= self.strategy.completed_rounds:
                    if await self._adopt(agreed):
                        await self._publish_round()
                    return
                await self.state.wait_changed()

    async def _repair_if_diverged(self) -> None:
        """Adopt the others' state when behind them or on a minority hash (see ``repair_target``)."""
        from lattica.train.outer_transfer import repair_target

        if time.monotonic() < self._next_repair_at:
            return
        target = repair_target(
            self.state.snapshot().get("progress", {}), self.state.live_members(), self.peer_id, self._mine
        )
        if target is None:
            return
        log.info("outer state differs from the swarm's round %d: adopting it", target[0])
        if await self._adopt(target):
            await self._publish_round()
        else:
            self._next_repair_at = time.monotonic() + _REPAIR_RETRY_S

    # -- progress ----------------------------------------------------------------------------

    def _on_progress(self, progress: Any) -> None:
        self.progress = {
            "step": progress.step,
            "round": progress.round,
            "loss": round(progress.loss, 4),
            "tokens_per_s": round(progress.tokens_per_s, 1),
            "lr": progress.lr,
            "val_loss": None if progress.val_loss is None else round(progress.val_loss, 4),
        }

    def _observe(self, histogram: str, seconds: float, **labels: str) -> None:
        metrics = getattr(self.node, "metrics", None)
        if metrics is not None:
            metric = getattr(metrics, histogram)
            (metric.labels(**labels) if labels else metric).observe(seconds)

    def _on_round(self, event: Any) -> None:
        self._bytes_sent += event.report.bytes_sent
        if len(event.report.group) > 1:
            op = "exchange" if self.settings.strategy == "noloco" else "allreduce"
            self._observe("collective_seconds", event.report.seconds, op=op)
        if event.report.skipped:
            return
        self._rounds_done += 1
        self._mine = (self.strategy.completed_rounds, event.state_hash)
        # a round run alone while others train is replaced by theirs (catch-up publishes that);
        # publishing it would offer the others a minority state
        if self._nursery is not None and not self._ran_alone(event.report):
            self._nursery.start_soon(self._publish_round)

    async def _publish_round(self) -> None:
        from lattica.train.join import outer_state_hash
        from lattica.train.outer_transfer import serve_outer_state

        outer = self.strategy.outer_state_dict()
        serve_outer_state(self.tensors, outer)
        digest = outer_state_hash(outer)  # weights and outer optimizer state: what joiners verify
        self._mine = (self.strategy.completed_rounds, digest)
        await self.state.set_progress(self.strategy.completed_rounds, digest)

    def _outer_hash(self) -> str:
        from lattica.train.join import outer_state_hash

        return outer_state_hash(self.strategy.outer_state_dict())

    # -- control API ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "phase": self.phase,
            "strategy": self.settings.strategy,
            "replicas_agree": bool(self.strategy is not None and self.strategy.replicas_agree),
            "rounds_target": self.settings.rounds,
            "rounds_completed": self.strategy.completed_rounds if self.strategy is not None else 0,
            "bytes_sent": self._bytes_sent,
            "device": self.trainer.device.describe() if self.trainer is not None else None,
            **self.progress,
        }
        if self.error:
            info["error"] = self.error
        if self.summary:
            info["summary"] = self.summary
        return {"training": info}

    async def handle_control(self, request: Any) -> Any:
        if request.method == "train":
            return self.status()["training"]
        return None


def _model_config(settings: TrainSettings) -> Any:
    """The preset, trained on sequences of ``seq_len`` tokens (at most the preset's context)."""
    from lattica.train.model import preset

    gpt = preset(settings.model)
    return dataclasses.replace(gpt, context=min(settings.seq_len, gpt.context))


def _moe_preset(model: str) -> str:
    from lattica.train.moe import MOE_PRESETS

    return model if model in MOE_PRESETS else "tiny-moe"


def check_settings(settings: TrainSettings) -> None:
    """Fail at start-up, as one line, on a strategy or model name that does not exist."""
    from lattica.train.model import preset
    from lattica.train.strategies import strategy_class

    try:
        strategy_class(settings.strategy)
        if settings.task is None:
            preset(settings.model)
    except (ValueError, KeyError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
