"""The trainer's inner loop at device speed: what each speed-up keeps exactly as it was (the
batches, the loss, the gradients, resumption) and how it behaves when it cannot run."""

from __future__ import annotations

import itertools
import logging
import threading

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.engine import compiled_model
from lattica.train.engine import trainer as trainer_module
from lattica.train.engine.activation_checkpoint import checkpoint_layers
from lattica.train.engine.batch_prefetch import BatchesEnded, BatchPrefetcher
from lattica.train.engine.checkpoint import CheckpointStore
from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig, build_model, lm_loss
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task, TaskContext, builtin_task, language_model_loss
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies import create_strategy
from lattica_lab.collective import InMemoryCollectiveGroup

MICRO = GPTConfig(n_layer=2, d_model=32, n_head=2, context=32)
CPU = select_device("cpu")


class FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


def _trainer(data, *, steps, log_every=2, eval_every=0, **config) -> Trainer:
    task = builtin_task(model=MICRO, data=data, batch_size=4, eval_batches=1, context=TaskContext(seed=5))
    strategy = create_strategy(
        "nocomm", task.model, collective=InMemoryCollectiveGroup(["a"]).member("a"), groups=FixedGroups(["a"]),
    )
    trainer_config = TrainerConfig(
        total_steps=steps, log_every=log_every, eval_every=eval_every,
        schedule=ScheduleConfig(lr=3e-3, warmup_steps=2, total_steps=steps), **config,
    )
    return Trainer(task, strategy, trainer_config, device=CPU)


# -- the loss stays on the device ----------------------------------------------------------------


class CountedLoss(torch.Tensor):
    """A loss that counts how often its value is read on the host."""

    reads = 0

    def __float__(self) -> float:
        CountedLoss.reads += 1
        return super().__float__()

    def item(self):
        CountedLoss.reads += 1
        return super().item()


async def test_the_loss_is_read_at_reports_only_not_at_every_step(text_data):
    trainer = _trainer(text_data, steps=16, log_every=8)
    trainer.task.loss_fn = lambda model, x, y: language_model_loss(model, x, y).as_subclass(CountedLoss)
    trainer.task.val_batches = ()  # validation reads its own losses
    reports = []
    trainer.on_progress = reports.append
    CountedLoss.reads = 0
    summary = await trainer.run()
    assert summary.steps == 16
    assert len(reports) <= 3  # steps 8 and 16, and the end of the run
    assert CountedLoss.reads <= len(reports) + 1, CountedLoss.reads  # and the summary's


# -- micro-batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [2, 3])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(text_data, parts):
    """Unequal parts too (4 rows in 3): each part's loss is weighted by its share of the batch."""
    whole, split = _trainer(text_data, steps=1), _trainer(text_data, steps=1, micro_batches=parts)
    x, y = next(iter(whole.task.train_batches))
    loss_whole = whole._backward(whole.model, x, y)
    loss_split = split._backward(split.model, x, y)
    torch.testing.assert_close(loss_split, loss_whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)


def test_micro_batches_are_checked():
    with pytest.raises(ValueError, match="micro_batches"):
        TrainerConfig(total_steps=1, micro_batches=0)
    with pytest.raises(ConfigError, match=r"micro_batches \(17\) must be at most train.batch_size \(16\)"):
        TrainSettings(micro_batches=17)
    with pytest.raises(ConfigError, match="micro_batches"):
        TrainSettings(micro_batches=0)


# -- activation checkpointing ----------------------------------------------------------------------


def test_checkpointed_layers_give_the_same_loss_and_gradients_and_names():
    plain, checkpointed = build_model(MICRO, seed=1), build_model(MICRO, seed=1)
    names = list(checkpointed.state_dict())
    assert checkpoint_layers(checkpointed) == MICRO.n_layer
    assert checkpoint_layers(checkpointed) == MICRO.n_layer  # idempotent: wrapped once
    assert list(checkpointed.state_dict()) == names
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    for model in (plain, checkpointed):
        lm_loss(model(x), x).backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    checkpointed.eval()
    with torch.no_grad():
        torch.testing.assert_close(checkpointed(x), plain.eval()(x), rtol=0, atol=0)


async def test_a_trainer_with_checkpointing_and_micro_batches_learns(text_data):
    trainer = _trainer(text_data, steps=30, log_every=10, micro_batches=2, activation_checkpointing=True)
    first = trainer.evaluate()
    summary = await trainer.run()
    assert summary.steps == 30
    assert trainer.evaluate() < first


# -- torch.compile ---------------------------------------------------------------------------------


def test_compile_is_on_for_cuda_and_off_for_the_cpu_unless_set():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiled_model.compile_enabled("auto", cuda)
    assert not compiled_model.compile_enabled("auto", cpu)
    assert compiled_model.compile_enabled(True, cpu)
    assert not compiled_model.compile_enabled(False, cuda)
    with pytest.raises(ValueError, match="compile"):
        TrainerConfig(total_steps=1, compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compile"):
        TrainSettings(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compile"):
        TrainSettings(compile=1)  # type: ignore[arg-type]


async def test_a_compile_failure_falls_back_to_eager_with_one_warning(text_data, monkeypatch, caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no code generator here")

    monkeypatch.setattr(compiled_model, "COMPILE_BACKEND", broken_backend)
    eager = _trainer(text_data, steps=6)
    await eager.run()
    trainer = _trainer(text_data, steps=6, compile=True)
    assert trainer.forward.compiled
    with caplog.at_level(logging.WARNING, logger="lattica.train.engine.compiled_model"):
        summary = await trainer.run()
    assert summary.steps == 6
    assert not trainer.forward.compiled
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1
    assert "\n" not in warnings[0].getMessage()
    # the failed first attempt left nothing behind: the same weights as a run that never compiled
    for a, b in zip(eager.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_an_error_of_the_task_is_not_taken_for_a_compile_failure(text_data, monkeypatch):
    trainer = _trainer(text_data, steps=2, compile=True)
    monkeypatch.setattr(trainer.forward, "module", trainer.model)  # a compiled call that runs eagerly

    def broken_loss(model, x, y):
        raise ValueError("the task's own bug")

    trainer.task.loss_fn = broken_loss
    with pytest.raises(ValueError, match="the task's own bug"):
        await trainer.run()


@pytest.mark.timeout(180)
async def test_a_compiled_trainer_trains_like_the_eager_one(text_data, monkeypatch):
    """Compiled through dynamo with its eager backend (inductor's code generation takes a
    minute and more on a small CPU; ``benchmarks/throughput.py --compile true`` runs it): the
    same losses as without compiling."""
    monkeypatch.setattr(compiled_model, "COMPILE_BACKEND", "eager")
    eager, compiled = _trainer(text_data, steps=4), _trainer(text_data, steps=4, compile=True)
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    eager.on_progress = lambda p: losses["eager"].append(p.loss)
    compiled.on_progress = lambda p: losses["compiled"].append(p.loss)
    await eager.run()
    await compiled.run()
    assert compiled.forward.compiled
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=1e-5, atol=1e-5)


# -- the inner optimizer ---------------------------------------------------------------------------


def test_the_default_inner_optimizer_is_fused_adamw(text_data):
    trainer = _trainer(text_data, steps=1)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert trainer.optimizer.defaults["fused"] is True


# -- batches prepared ahead ------------------------------------------------------------------------


def _numbered(count: int | None = None):
    for i in itertools.count() if count is None else range(count):
        yield torch.full((2, 3), i), torch.full((2, 3), -i)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prepared_batches_come_in_the_iterators_order_and_its_end_is_raised_in_place(depth):
    with BatchPrefetcher(_numbered(5), torch.device("cpu"), depth=depth) as batches:
        got = [int(batches.next()[0][0, 0]) for _ in range(5)]
        with pytest.raises(BatchesEnded):
            batches.next()
    assert got == [0, 1, 2, 3, 4]


def test_a_bad_batch_or_an_error_of_the_iterator_is_raised_where_it_would_have_been():
    def failing():
        yield torch.zeros(1), torch.zeros(1)
        raise OSError("the disk went away")

    with BatchPrefetcher(failing(), torch.device("cpu"), depth=2) as batches:
        batches.next()
        with pytest.raises(OSError, match="disk went away"):
            batches.next()
    with BatchPrefetcher(iter([torch.zeros(2)]), torch.device("cpu"), depth=2) as batches, \
            pytest.raises(ConfigError, match=r"\(x, y\)"):
        batches.next()


def test_closing_stops_a_producer_that_is_ahead():
    before = threading.active_count()
    batches = BatchPrefetcher(_numbered(), torch.device("cpu"), depth=2)
    batches.next()
    batches.close()
    assert threading.active_count() == before


class _CountingSampler:
    def __init__(self):
        self.drawn = 0

    def __iter__(self):
        while True:
            self.drawn += 1
            yield torch.full((1, 2), self.drawn), torch.full((1, 2), self.drawn)

    def state_dict(self):
        return {"drawn": self.drawn}


def test_the_resume_state_is_after_the_last_batch_taken_not_the_producers():
    sampler = _CountingSampler()
    with BatchPrefetcher(iter(sampler), torch.device("cpu"), depth=3, sampler=sampler) as batches:
        assert batches.resume_state == {"drawn": 0}
        batches.next()
        batches.next()
        trio.run(trio.sleep, 0.3)  # the producer fills its queue meanwhile
        assert sampler.drawn > 2
        assert batches.resume_state == {"drawn": 2}


async def test_a_run_with_batches_prepared_ahead_resumes_like_an_uninterrupted_one(text_data, tmp_path, monkeypatch):
    """The producer thread runs ahead of the steps; a checkpoint holds the sampler where the
    steps left it, so a resumed run draws the batches an uninterrupted one would."""
    monkeypatch.setattr(trainer_module, "prefetch_depth", lambda device: 2)
    straight = _trainer(text_data, steps=12)
    await straight.run()
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    first = _trainer(text_data, steps=6)
    first.checkpoints = store
    first.config = TrainerConfig(
        total_steps=6, log_every=2, eval_every=0, schedule=ScheduleConfig(lr=3e-3, warmup_steps=2, total_steps=12),
    )
    await first.run()
    store.save(first.step, first.state_dict())
    second = _trainer(text_data, steps=12)
    second.checkpoints = store
    assert second.resume()
    assert second.step == 6
    await second.run()
    for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_the_step_that_runs_out_of_batches_is_named(monkeypatch):
    monkeypatch.setattr(trainer_module, "prefetch_depth", lambda device: 2)
    model = build_model(MICRO, seed=0)
    task = Task(model=model, train_batches=iter([(torch.zeros(1, 4, dtype=torch.long),) * 2] * 3))
    strategy = create_strategy(
        "nocomm", model, collective=InMemoryCollectiveGroup(["a"]).member("a"), groups=FixedGroups(["a"]),
    )
    trainer = Trainer(task, strategy, TrainerConfig(total_steps=5, eval_every=0), device=CPU)
    with pytest.raises(ConfigError, match="ran out at step 4"):
        await trainer.run()
