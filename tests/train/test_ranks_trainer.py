"""A node of two CPU ranks (``devices = "cpu:2"``: real rank processes, gloo on loopback)
against a one-rank node given the same node batch and data order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.ranks.trainer import RankedTrainer
from lattica.train.engine.trainer import Trainer
from lattica.train.settings import trainer_factory
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

pytestmark = pytest.mark.timeout(120)


def _trainer(settings: TrainSettings, tmp_path: Path, name: str) -> Trainer:
    group = InMemoryCollectiveGroup(["me"])
    parts = trainer_factory.TrainerParts(
        peer_id="me", collective=group.member("me"), groups=FixedGroups(["me"]), checkpoint_dir=tmp_path / name,
    )
    return trainer_factory.build_trainer(settings, parts)


def _settings(text_data: Any, devices: str, **extra: Any) -> TrainSettings:
    return TrainSettings(strategy="nocomm", model="tiny", data=text_data.source, inner_steps=3, rounds=2,
                         device="cpu", devices=devices, batch_size=4, seq_len=16, warmup_steps=1, **extra)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_two_ranks_take_the_steps_of_one_rank_given_the_same_node_batch(tmp_path: Path, text_data: Any) -> None:
    one = _trainer(_settings(text_data, "cpu"), tmp_path, "one")
    two = _trainer(_settings(text_data, "cpu:2"), tmp_path, "two")
    assert isinstance(two, RankedTrainer)
    assert not isinstance(one, RankedTrainer)
    assert weights_hash(_weights(one)) == weights_hash(_weights(two))  # the same initial model

    summaries = [trio.run(one.run), trio.run(two.run)]
    assert [s.steps for s in summaries] == [6, 6]
    assert summaries[1].tokens == summaries[0].tokens  # the node's batch, split between the ranks
    assert summaries[1].train_loss == pytest.approx(summaries[0].train_loss, abs=1e-4)
    assert summaries[1].val_loss == pytest.approx(summaries[0].val_loss, abs=1e-4)
    for name, tensor in _weights(one).items():
        torch.testing.assert_close(_weights(two)[name], tensor, atol=1e-4, rtol=1e-4)
    status = two.device_status()
    assert [d["name"] for d in status["devices"]] == ["cpu:0", "cpu:1"]
    assert status["ranks_agree"] is True  # the ranks' weights are bit-identical after every phase
    assert all(d["tokens_per_s"] > 0 for d in status["devices"])
