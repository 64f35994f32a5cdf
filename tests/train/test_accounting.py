"""Every strategy accounts for its traffic and memory, and the figures match what was sent."""

import pytest
import torch
import trio

from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.moe import MoEConfig, build_moe_model
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies import STRATEGIES, strategy_class
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

PEERS = ("a", "b")
STEPS = 8
SETTINGS = {  # two syncs or more in STEPS steps
    "inner_steps": 4,
    "sync_every": 4,
    "merge_every": 4,
    "members": PEERS,
}
GPT = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
MOE = MoEConfig(n_layer=1, d_model=16, n_head=2, context=8, num_experts=4, expert_hidden=16)


def _batches(seed):
    generator = torch.Generator().manual_seed(seed)
    while True:
        data = torch.randint(0, 256, (2, 9), generator=generator)
        yield data[:, :-1], data[:, 1:]


def _trainer(name, me, network):
    model = build_moe_model(MOE, seed=0) if name == "spes" else build_model(GPT, seed=0)
    cls = strategy_class(name)
    config_cls = getattr(cls, "config_class", None)
    config = None
    if config_cls is not None:
        fields = config_cls.__dataclass_fields__
        config = config_cls(**{k: v for k, v in SETTINGS.items() if k in fields})
    strategy = cls(model, collective=network.member(me), groups=FixedGroups(PEERS), config=config)
    task = Task(model=model, train_batches=_batches(ord(me)))
    trainer_config = TrainerConfig(
        total_steps=STEPS,
        eval_every=0,
        log_every=STEPS,
        schedule=ScheduleConfig(lr=1e-3, warmup_steps=1, total_steps=STEPS),
    )
    return Trainer(task, strategy, trainer_config, device=select_device("cpu"))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
async def test_accounting_matches_the_bytes_put_on_the_wire(name):
    network = InMemoryCollectiveGroup(list(PEERS))
    trainers = [_trainer(name, me, network) for me in PEERS]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for trainer in trainers:
                nursery.start_soon(trainer.run)
    for me, trainer in zip(PEERS, trainers, strict=True):
        figures = trainer.strategy.accounting()
        assert figures["bytes_sent"] == network.bytes_sent[me]
        if name == "demo":
            # DeMo steps the weights itself (sign of the averaged components): the inner
            # optimizer never sees a gradient, and the momentum it keeps is its outer state.
            assert figures["inner_optimizer_state_bytes"] == 0
            assert figures["outer_state_bytes"] >= sum(
                p.numel() * 4 for p in trainer.model.parameters() if p.requires_grad
            )
        else:
            assert figures["inner_optimizer_state_bytes"] > 0
        params = sum(p.numel() * 4 for p in trainer.model.parameters())
        assert figures["trainable_parameter_bytes"] + figures["frozen_parameter_bytes"] == params
        if name == "nocomm":
            assert figures["syncs"] == figures["bytes_sent"] == figures["peak_sync_bytes"] == 0
            continue
        assert figures["syncs"] >= 2
        assert 0 < figures["last_sync_bytes"] <= figures["peak_sync_bytes"] <= figures["bytes_sent"]
        if name in ("diloco", "eager", "noloco", "streaming"):
            assert figures["outer_state_bytes"] >= params  # outer weights (+ momentum)
        if name == "spes":
            assert figures["frozen_parameter_bytes"] > 0  # the other node's experts
