import threading

import pytest
import torch
import trio

from lattica.errors import ConfigError
from lattica.train.engine.checkpoint import CheckpointStore, weights_hash
from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task, TaskContext, builtin_task, language_model_loss
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies import create_strategy
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup

MICRO = GPTConfig(n_layer=1, d_model=32, n_head=2, context=32)
CPU = select_device("cpu")
DILOCO3 = DiLoCoConfig(inner_steps=3)


class FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


def _trainer(
    data,
    *,
    steps,
    schedule_steps=None,
    peers=("a",),
    me="a",
    network=None,
    strategy="diloco",
    config=DILOCO3,
    shard=0,
    lr=3e-3,
    plain_sgd=False,
    eval_every=4,
    grad_clip=1.0,
    **kwargs,
):
    """A trainer of the micro GPT; ``plain_sgd`` swaps the inner AdamW for SGD at ``lr``."""
    network = network or InMemoryCollectiveGroup(list(peers))
    task = builtin_task(
        model=MICRO,
        data=data,
        batch_size=4,
        eval_batches=2,
        context=TaskContext(shard_index=shard, num_shards=len(peers), seed=5),
    )
    if plain_sgd:
        task.optimizer = torch.optim.SGD(task.model.parameters(), lr=lr)
    outer = create_strategy(
        strategy,
        task.model,
        collective=network.member(me),
        groups=FixedGroups(peers),
        config=config,
    )
    cfg = TrainerConfig(
        total_steps=steps,
        eval_every=eval_every,
        grad_clip=grad_clip,
        log_every=2,
        schedule=ScheduleConfig(lr=lr, warmup_steps=2, total_steps=schedule_steps or steps),
    )
    return Trainer(task, outer, cfg, device=CPU, **kwargs)


async def test_inner_steps_run_off_the_trio_thread(text_data):
    trainer = _trainer(text_data, steps=8, strategy="nocomm", config=None)
    threads, ticks = set(), []
    inner_loss = trainer.task.loss_fn

    def slow_loss(model, x, y):
        threads.add(threading.current_thread().name)
        threading.Event().wait(0.02)  # a long inner step
        return inner_loss(model, x, y)

    trainer.task.loss_fn = slow_loss

    async def ticker():
        while True:
            ticks.append(trio.current_time())
            await trio.sleep(0.002)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            summary = await trainer.run()
            nursery.cancel_scope.cancel()
    assert summary.steps == 8
    assert threading.main_thread().name not in {t for t in threads if t}
    training_steps = 8 + 3  # inner steps + validation batches at steps 4, 8 and the end
    assert len(ticks) > 2 * training_steps


async def test_progress_rounds_and_hashes(text_data):
    progress, rounds = [], []
    trainer = _trainer(text_data, steps=6, on_progress=progress.append, on_round=rounds.append)
    summary = await trainer.run()
    assert [r.step for r in rounds] == [3, 6]
    assert rounds[-1].weights_hash == weights_hash(trainer.strategy.outer_state_dict()["params"])
    assert rounds[0].weights_hash != rounds[1].weights_hash
    assert summary.rounds == 2
    assert summary.val_loss is not None
    assert summary.val_loss < 5.5  # better than uniform over bytes
    assert [p.step for p in progress if p.val_loss is not None] == [4, 6]
    assert all(p.tokens_per_s > 0 for p in progress)
    assert summary.tokens == 6 * 4 * 32


async def test_the_summary_keeps_the_loss_of_the_first_report(text_data):
    progress = []
    trainer = _trainer(text_data, steps=12, on_progress=progress.append)
    summary = await trainer.run()
    assert summary.first_loss == progress[0].loss  # step 2: how far the loss fell since then
    assert summary.first_loss is not None
    assert summary.first_loss > summary.train_loss


async def test_resume_from_checkpoint_matches_uninterrupted_run(text_data, tmp_path):
    straight = _trainer(text_data, steps=12)
    await straight.run()

    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    first = _trainer(text_data, steps=6, schedule_steps=12, checkpoints=store)
    await first.run()
    assert [s for s, _ in store.checkpoints()] == [3, 6]

    second = _trainer(text_data, steps=12, checkpoints=store)
    assert second.resume()
    assert second.step == 6
    assert second.strategy.completed_rounds == 2
    await second.run()
    for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_two_replicas_with_diloco_stay_identical_and_joiner_adopts(text_data):
    peers = ("a", "b")
    network = InMemoryCollectiveGroup(list(peers))
    trainers = [
        _trainer(text_data, steps=6, peers=peers, me=p, network=network, shard=i)
        for i, p in enumerate(peers)
    ]
    async with trio.open_nursery() as nursery:
        for t in trainers:
            nursery.start_soon(t.run)
    a, b = (t.strategy.outer_state_dict() for t in trainers)
    assert weights_hash(a["params"]) == weights_hash(b["params"])
    assert network.bytes_sent["a"] > 0

    joiner = _trainer(text_data, steps=9, peers=peers, me="b")
    joiner.adopt_outer_state(a)
    assert joiner.step == 6
    assert joiner.strategy.round == 2
    for p, q in zip(joiner.model.parameters(), trainers[0].model.parameters(), strict=True):
        assert torch.equal(p, q)


async def test_ddp_replicas_stay_identical_every_step(text_data):
    peers = ("a", "b")
    network = InMemoryCollectiveGroup(list(peers))
    trainers = [
        _trainer(
            text_data,
            steps=3,
            peers=peers,
            me=p,
            network=network,
            shard=i,
            strategy="ddp",
            config=None,
        )
        for i, p in enumerate(peers)
    ]
    async with trio.open_nursery() as nursery:
        for t in trainers:
            nursery.start_soon(t.run)
    for p, q in zip(trainers[0].model.parameters(), trainers[1].model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert trainers[0].strategy.completed_rounds == 3


async def test_ddp_is_diloco_with_one_inner_sgd_step_and_plain_outer_averaging(text_data):
    """With inner plain SGD, H = 1, outer lr 1 and no momentum, DiLoCo's outer step is
    φ − mean_m(lr·g_m): exactly the data-parallel update on the same per-worker batches."""

    async def train(strategy, config):
        peers = ("a", "b", "c")
        network = InMemoryCollectiveGroup(list(peers))
        trainers = [
            _trainer(
                text_data,
                steps=4,
                peers=peers,
                me=p,
                network=network,
                shard=i,
                strategy=strategy,
                config=config,
                lr=0.5,
                plain_sgd=True,
                eval_every=0,
                grad_clip=0.0,
            )
            for i, p in enumerate(peers)
        ]
        async with trio.open_nursery() as nursery:
            for t in trainers:
                nursery.start_soon(t.run)
        return [list(t.model.parameters()) for t in trainers]

    ddp = await train("ddp", None)
    diloco = await train("diloco", DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
    initial = builtin_task(model=MICRO, data=text_data, eval_batches=1).model.parameters()
    moved = False
    for a, b, start in zip(ddp[0], diloco[0], initial, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        moved |= not torch.equal(a, start)
    assert moved
    for replica in diloco[1:]:
        for a, b in zip(diloco[0], replica, strict=True):
            assert torch.equal(a, b)


async def test_bad_batches_from_a_task_are_config_errors(text_data):
    network = InMemoryCollectiveGroup(["a"])
    model = torch.nn.Linear(2, 2)
    for batches, message in [(iter([]), "ran out"), (iter([torch.zeros(2)]), r"\(x, y\)")]:
        task = Task(model=model, train_batches=batches, loss_fn=language_model_loss)
        strategy = create_strategy(
            "nocomm", model, collective=network.member("a"), groups=FixedGroups(["a"])
        )
        trainer = Trainer(task, strategy, TrainerConfig(total_steps=1), device=CPU)
        with pytest.raises(ConfigError, match=message):
            await trainer.run()


def test_trainer_config_validation():
    with pytest.raises(ValueError, match="total_steps"):
        TrainerConfig(total_steps=0)


async def test_annotations_travel_with_the_checkpoint(text_data, tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    first = _trainer(text_data, steps=3, checkpoints=store)
    first.annotations["outer_history"] = {1: "abc"}
    await first.run()
    second = _trainer(text_data, steps=6, checkpoints=store)
    assert second.resume()
    assert second.annotations == {"outer_history": {1: "abc"}}


async def test_steps_between_syncs_run_in_one_thread_call_with_the_same_result(text_data):
    batched = _trainer(text_data, steps=9, config=DiLoCoConfig(inner_steps=3))
    calls = []
    original = batched.strategy.after_inner_step

    async def recording(step):
        calls.append(step)
        return await original(step)

    batched.strategy.after_inner_step = recording
    await batched.run()

    stepwise = _trainer(text_data, steps=9, config=DiLoCoConfig(inner_steps=3))
    stepwise.strategy.next_sync_step = lambda step: step + 1  # the always-correct default
    await stepwise.run()

    # syncs at 3, 6, 9; reports every 2 steps; validation every 4
    assert calls == [2, 3, 4, 6, 8, 9]
    for a, b in zip(batched.model.parameters(), stepwise.model.parameters(), strict=True):
        assert torch.equal(a, b)


async def test_cancelling_stops_the_worker_between_steps(text_data):
    trainer = _trainer(text_data, steps=100_000, strategy="nocomm", config=None)
    trainer.config = TrainerConfig(total_steps=100_000, eval_every=0, log_every=100_000)
    with trio.move_on_after(2.0):
        await trainer.run()
    stopped_at = trainer.step
    assert 0 < stopped_at < 100_000
    await trio.sleep(0.3)
    assert trainer.step == stopped_at  # the worker thread did not go on after the cancel


async def test_streaming_syncs_in_the_worker_thread_give_the_trio_thread_result(text_data, tmp_path):
    from lattica.train.strategies.streaming import StreamingDiLoCoConfig

    config = StreamingDiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=1)
    peers = ("a", "b")
    runs = {}
    # with a checkpoint store every sync is taken on the trio thread; without, in the worker
    # thread whenever its mean has arrived
    for path in ("trio", "worker"):
        network = InMemoryCollectiveGroup(list(peers))
        rounds = {p: [] for p in peers}
        trainers = [
            _trainer(
                text_data, steps=14, peers=peers, me=p, network=network, strategy="streaming",
                config=config, shard=i, on_round=rounds[p].append,
                checkpoints=CheckpointStore(tmp_path / p, keep=1) if path == "trio" else None,
            )
            for i, p in enumerate(peers)
        ]
        async with trio.open_nursery() as nursery:
            for t in trainers:
                nursery.start_soon(t.run)
        runs[path] = (trainers, rounds)
    (on_trio, trio_rounds), (in_worker, worker_rounds) = runs["trio"], runs["worker"]
    for a, b in zip(on_trio, in_worker, strict=True):
        for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
            assert torch.equal(x, y)
        assert a.bytes_sent == b.bytes_sent > 0
    for p in peers:  # fragment syncs start at 4, 6, 8, 10, 12, 14 and apply one step later
        assert [r.step for r in trio_rounds[p]] == [r.step for r in worker_rounds[p]]
        assert [r.step for r in worker_rounds[p]] == [5, 7, 9, 11, 13, 14]
        assert [r.weights_hash for r in trio_rounds[p]] == [r.weights_hash for r in worker_rounds[p]]


async def test_cancelling_releases_a_worker_waiting_for_a_late_streaming_mean(text_data):
    from lattica.train.strategies.streaming import StreamingDiLoCoConfig

    # "b" never trains: the mean of the first fragment sync never arrives
    trainer = _trainer(
        text_data, steps=1000, peers=("a", "b"), strategy="streaming",
        config=StreamingDiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=1),
    )
    trainer.config = TrainerConfig(total_steps=1000, eval_every=0, log_every=1000)
    with trio.fail_after(20):
        with trio.move_on_after(2.0) as waiting:
            await trainer.run()
    assert waiting.cancelled_caught
    assert trainer.step == 5  # the sync of step 4 is due at 5: the worker waited there
