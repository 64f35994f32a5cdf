"""The strategy interface: declared capabilities, the shared every-H schedule, and a wrapper
that forwards every hook (the daemon's outer-state sync wraps strategies instead of patching
them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lattica.config import TrainSettings
from lattica.train.engine.moe import MoEConfig, build_moe_model
from lattica.train.settings import trainer_factory
from lattica.train.strategies import STRATEGIES, strategy_class
from lattica.train.strategies.base import (
    EveryHSteps,
    OuterStepReport,
    OuterStrategy,
    StrategyHandles,
    WrappedStrategy,
)
from lattica.train.strategies.experts import DerivedOwnership
from lattica.train.strategies.spes import SPES, SPESConfig
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup


def _interface() -> set[str]:
    """Every public method and property a strategy offers the trainer and the service."""
    return {
        name for name, member in vars(OuterStrategy).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property | classmethod))
    } | {"name", "replicas_agree", "syncs_gradients"}


def test_the_wrapper_forwards_the_whole_interface() -> None:
    """A hook added to ``OuterStrategy`` must be forwarded too, or a wrapped strategy would
    silently fall back to the default (only class-level capabilities are read off the class)."""
    class_level = {"averages_in_groups", "trains_experts", "config_class", "build", "default_config"}
    missing = sorted(n for n in _interface() - class_level if n not in vars(WrappedStrategy))
    assert missing == []


class _Counting(EveryHSteps):
    def __init__(self, h: int) -> None:
        super().__init__(torch.nn.Linear(1, 1), collective=None, groups=None)  # type: ignore[arg-type]
        self.h, self.synced = h, []

    @property
    def sync_interval(self) -> int:
        return self.h

    async def sync_at(self, step: int) -> OuterStepReport:
        self.synced.append(step)
        return OuterStepReport(round=len(self.synced) - 1, key=f"round/{len(self.synced) - 1}", group=("me",),
                               bytes_sent=0, seconds=0.0, consensus_distance=0.25)

    @property
    def completed_rounds(self) -> int:
        return len(self.synced)

    def outer_state_dict(self) -> dict[str, Any]:
        return {"synced": list(self.synced)}

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        self.synced = list(state["synced"])


async def test_every_h_steps_syncs_at_multiples_of_h_only() -> None:
    strategy = _Counting(4)
    assert [strategy.next_sync_step(s) for s in (0, 3, 4, 7, 8)] == [4, 4, 8, 8, 12]
    for step in range(1, 13):
        reports = await strategy.after_inner_step(step)
        assert len(reports) == (1 if step % 4 == 0 else 0)
    assert strategy.synced == [4, 8, 12]


async def test_a_wrapped_strategy_behaves_as_the_strategy_it_wraps() -> None:
    inner = _Counting(3)
    wrapped = WrappedStrategy(inner)
    reports = await wrapped.after_inner_step(3)
    assert [r.consensus_distance for r in reports] == [0.25]  # a per-round figure comes in the report
    assert inner.synced == [3]
    assert wrapped.next_sync_step(3) == 6
    assert wrapped.completed_rounds == 1
    assert wrapped.outer_state_dict() == {"synced": [3]}
    wrapped.load_outer_state_dict({"synced": [3, 6]})
    assert inner.synced == [3, 6]
    assert wrapped.accounting() == {}
    assert wrapped.replicas_agree is False


@pytest.mark.parametrize(
    ("settings", "in_groups"),
    [
        (TrainSettings(strategy="diloco"), False),
        (TrainSettings(strategy="diloco", averaging="gossip"), True),
        (TrainSettings(strategy="noloco"), True),
        (TrainSettings(strategy="sparseloco"), False),
        (TrainSettings(strategy="sparseloco", averaging="gossip"), True),
        (TrainSettings(strategy="streaming"), False),
        (TrainSettings(strategy="eager"), False),
        (TrainSettings(strategy="ddp"), False),
    ],
)
def test_group_averaging_is_a_declared_capability(settings: TrainSettings, in_groups: bool) -> None:
    assert trainer_factory.averages_in_groups(settings) is in_groups


def test_only_spes_trains_experts_and_not_with_a_user_task() -> None:
    assert sorted(n for n in STRATEGIES if strategy_class(n).trains_experts) == ["spes"]
    assert trainer_factory.trains_experts(TrainSettings(strategy="spes"))
    assert not trainer_factory.trains_experts(TrainSettings(strategy="spes", task="mypkg.tasks:build"))


async def test_a_strategy_built_by_the_factory_syncs_through_what_it_is_given(tmp_path: Any, text_data: Any) -> None:
    """The trainer factory builds the run settings' strategy around the given Collective and
    GroupProvider, and the trainer holds it inside ``wrap``."""
    group = InMemoryCollectiveGroup(["me"])
    wrapped: list[OuterStrategy] = []

    def wrap(strategy: OuterStrategy) -> OuterStrategy:
        wrapped.append(strategy)
        return WrappedStrategy(strategy)

    settings = TrainSettings(strategy="diloco", model="tiny", data=text_data.source, inner_steps=2, rounds=1,
                             device="cpu", warmup_steps=1)
    parts = trainer_factory.TrainerParts(
        peer_id="me", collective=group.member("me"), groups=FixedGroups(["me"]),
        checkpoint_dir=tmp_path / "checkpoints",
    )
    trainer = trainer_factory.build_trainer(settings, parts, wrap=wrap)
    assert isinstance(trainer.strategy, WrappedStrategy)
    assert trainer.strategy.inner is wrapped[0]
    assert wrapped[0].name == "diloco"
    assert trainer.config.total_steps == 2


def test_build_hands_a_strategy_the_node_handles_it_takes() -> None:
    peers = ["a", "b"]
    group, groups = InMemoryCollectiveGroup(peers), FixedGroups(peers)
    moe = MoEConfig(n_layer=1, d_model=8, n_head=2, context=8, num_experts=4, top_k=2, expert_hidden=8)
    ownership = DerivedOwnership(("b", "c"), moe.num_experts)  # the node's, not the config's members
    handles = StrategyHandles(ownership=ownership)
    spes = strategy_class("spes").build(
        build_moe_model(moe, seed=0), collective=group.member("a"), groups=groups,
        config=SPESConfig(members=tuple(peers)), handles=handles,
    )
    assert isinstance(spes, SPES)
    assert spes.ownership is ownership
    assert spes.owned_experts == []  # "a" owns none in the node's map
    diloco = strategy_class("diloco").build(
        torch.nn.Linear(2, 2), collective=group.member("a"), groups=groups, config=None, handles=handles,
    )
    assert diloco.name == "diloco"
    with pytest.raises(TypeError, match="mixture-of-experts"):
        strategy_class("spes").build(
            torch.nn.Linear(2, 2), collective=group.member("a"), groups=groups, config=None, handles=handles,
        )


def test_spes_reads_gossip_averaging_from_its_own_config_only() -> None:
    class Lookalike:  # a config of another kind that happens to have the field
        averaging = "gossip"

    assert SPES.averages_in_groups(SPESConfig(averaging="gossip"))
    assert not SPES.averages_in_groups(SPESConfig())
    assert not SPES.averages_in_groups(Lookalike())
