"""Every strategy trains a Llama preset (in memory, two workers): the model family changes
nothing about the outer step; replicas that agree end bit-identical."""

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.llama import LLAMA_PRESETS, build_llama
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies import STRATEGIES, strategy_class
from lattica.train.strategies.base import StrategyHandles
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

PEERS = ("w0", "w1")
CONFIG = LLAMA_PRESETS["llama-tiny"].with_vocab(64)
H = 4


def _batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 64, (2, 17), generator=generator)
        yield x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if not strategy_class(n).trains_experts))
async def test_every_strategy_trains_llama_tiny(name):
    settings = TrainSettings(strategy=name, model="llama-tiny", inner_steps=H, rounds=2)
    network = InMemoryCollectiveGroup(PEERS)
    trainers = []
    for i, peer in enumerate(PEERS):
        model = build_llama(CONFIG, seed=0)
        strategy = strategy_class(name).build(
            model, collective=network.member(peer), groups=FixedGroups(PEERS),
            config=strategy_config(settings), handles=StrategyHandles(),
        )
        task = Task(model=model, train_batches=_batches(i))
        config = TrainerConfig(total_steps=2 * H, eval_every=0, log_every=H,
                               schedule=ScheduleConfig(lr=1e-3, warmup_steps=1, total_steps=2 * H))
        trainers.append(Trainer(task, strategy, config))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for trainer in trainers:
                nursery.start_soon(trainer.run)
    assert all(torch.isfinite(torch.tensor(t.last_loss)) for t in trainers)
    if strategy_class(name).replicas_agree:
        hashes = {weights_hash(t.strategy.outer_state_dict().get("params") or t.model.state_dict()) for t in trainers}
        assert len(hashes) == 1
