"""The validation loss a finished replica reports is the one of the weights it ends on.

A replica whose last round ran alone (or was skipped) finishes its run on weights that the swarm
does not keep; after the run it adopts the swarm's final state (``TrainingService._settle``).
Its summary must then report the adopted weights' validation loss, the same figure every other
replica reports, not the loss of the weights it replaced. The same ordering runs across real
daemons in ``test_swarm_training.py::test_three_daemons_end_with_identical_outer_weights``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
import trio

from lattica.config import TrainSettings
from lattica.crdt.liveness import LeasePolicy
from lattica.train.engine.data import DataConfig
from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig
from lattica.train.engine.reports import Progress, TrainingSummary
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import TaskContext, builtin_task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.service import TrainingService
from lattica.train.strategies import create_strategy
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

MICRO = GPTConfig(n_layer=1, d_model=32, n_head=2, context=32)


class _OneGroup:
    def __init__(self, members: tuple[str, ...]) -> None:
        self.members = members

    async def group_for(self, key: Any) -> tuple[str, ...]:
        return self.members


def _diloco_trainer(data: DataConfig, *, seed: int, on_progress: Any = None) -> Trainer:
    """A DiLoCo replica of the micro GPT that syncs alone: 2 rounds of 3 inner steps."""
    task = builtin_task(model=MICRO, data=data, batch_size=4, eval_batches=2, context=TaskContext(seed=seed))
    strategy = create_strategy(
        "diloco", task.model, collective=InMemoryCollectiveGroup(["me"]).member("me"),
        groups=_OneGroup(("me",)), config=DiLoCoConfig(inner_steps=3),
    )
    config = TrainerConfig(
        total_steps=6, eval_every=3, log_every=3, schedule=ScheduleConfig(lr=3e-3, warmup_steps=2, total_steps=6)
    )
    return Trainer(task, strategy, config, device=select_device("cpu"), on_progress=on_progress)


@dataclasses.dataclass
class _Finished:
    swarm: Trainer  # the replica whose final state the swarm keeps
    lone: Trainer  # a replica that trained its rounds on other data
    final_val_loss: float  # what ``swarm.run()`` reported
    lone_summary: TrainingSummary  # what ``lone.run()`` reported
    reports: list[Progress]  # the lone replica's progress reports


async def _finished(data: DataConfig) -> _Finished:
    reports: list[Progress] = []
    swarm, lone = _diloco_trainer(data, seed=1), _diloco_trainer(data, seed=2, on_progress=reports.append)
    final = (await swarm.run()).val_loss
    lone_summary = await lone.run()
    assert final is not None
    assert lone_summary.val_loss is not None
    assert final != lone_summary.val_loss  # different data: different weights
    return _Finished(swarm, lone, final, lone_summary, reports)


async def test_a_state_adopted_after_the_run_is_validated_before_it_is_reported(text_data: DataConfig) -> None:
    run = await _finished(text_data)
    swarm, lone = run.swarm, run.lone

    lone.adopt_outer_state(swarm.strategy.outer_state_dict())
    # the figure of the replaced weights is gone, not reported as the adopted state's
    assert lone.last_val_loss is None
    assert await lone.revalidate() == run.final_val_loss
    assert lone.summary().val_loss == run.final_val_loss
    assert dataclasses.replace(lone.summary(), val_loss=None) == dataclasses.replace(run.lone_summary, val_loss=None)
    assert run.reports[-1].val_loss == run.final_val_loss
    assert run.reports[-1].round == swarm.strategy.completed_rounds
    for p, q in zip(lone.model.parameters(), swarm.model.parameters(), strict=True):
        assert torch.equal(p, q)


async def test_a_replica_repaired_after_its_run_reports_the_final_states_val_loss(text_data: DataConfig) -> None:
    """``TrainingService._settle``: the run ended on weights of its own, then the repair adopts
    the swarm's final state; ``status()`` must show the adopted state's val loss."""
    run = await _finished(text_data)
    swarm, lone = run.swarm, run.lone
    service = _service()
    service.trainer, service.strategy = lone, lone.strategy
    lone.on_progress = service._on_progress
    service.summary = dataclasses.asdict(run.lone_summary)  # what ``_train`` keeps when run() returns
    service.phase = "done"
    final = swarm.strategy.outer_state_dict()
    repairs: list[int] = []

    async def repair() -> bool:  # the swarm's final state, as ``_adopt`` installs it once fetched
        if repairs:
            return False
        repairs.append(1)
        lone.adopt_outer_state(final)
        return True

    async def nothing_to_publish() -> None:
        return None

    service.outer_sync.repair_if_diverged = repair  # type: ignore[method-assign]
    service.outer_sync.publish_if_unpublished = nothing_to_publish  # type: ignore[method-assign]

    def reported() -> Any:
        return service.status()["training"]["summary"]["val_loss"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._settle, lone)
        with trio.fail_after(60):
            while not (repairs and service.progress.get("round") == swarm.strategy.completed_rounds):
                await trio.sleep(0.01)  # until the repaired replica reported its progress
        nursery.cancel_scope.cancel()
    expected = run.final_val_loss
    assert reported() == expected
    assert service.status()["training"]["val_loss"] == round(expected, 4)


def _service() -> TrainingService:
    async def wait_changed() -> None:
        await trio.sleep_forever()

    state = SimpleNamespace(config=SimpleNamespace(lease=LeasePolicy()), wait_changed=wait_changed,
                            live_members=list, snapshot=dict)
    fetch_seconds = SimpleNamespace(observe=lambda seconds: None)
    node = SimpleNamespace(
        peer_id=SimpleNamespace(to_base58=lambda: "me"), host=None, config=SimpleNamespace(run_id="run"),
        metrics=SimpleNamespace(checkpoint_fetch_seconds=fetch_seconds),
    )
    tensors = SimpleNamespace(stats=SimpleNamespace(total_received=lambda: 0, rejected_contributions={}))
    return TrainingService(node, state, TrainSettings(), tensors=tensors)  # type: ignore[arg-type]
