"""The run agrees on model and data: the model hash and a prepared corpus's manifest hash."""

import pytest

from lattica.config import TrainSettings
from lattica.crdt.config import StateConfig
from lattica.errors import ConfigError, LocalProtocolError
from lattica.train.swarm.membership import MembershipView
from lattica.train.swarm.run_config import agree_run_identity, apply_run_config, run_config_of

MINE = {"model_hash": "a" * 64, "data_hash": "b" * 64}


class _RunConfigState:
    """The run-config part of the replicated state, in memory."""

    def __init__(self, config, *, admin: bool) -> None:
        self.run_config, self.admin = dict(config), admin
        self.config = StateConfig()
        self.admins: frozenset[str] = frozenset()

    def snapshot(self):
        return {"config": dict(self.run_config), "members": {}}

    def live_members(self):
        return []

    async def wait_changed(self) -> None:
        raise AssertionError("nobody is waited for here")

    async def set_run_config(self, config) -> None:
        if not self.admin:
            raise LocalProtocolError("only admin keys may change the run config")
        self.run_config = dict(config)


def _view(config, *, admin):
    state = _RunConfigState(config, admin=admin)
    return MembershipView(state, peer_id="me"), state


async def test_an_admin_adds_its_model_and_data_hashes_to_the_run_config():
    settings = TrainSettings(model="llama-tiny")
    view, state = _view(run_config_of(settings), admin=True)
    await agree_run_identity(view, settings, MINE, wait_s=1)
    assert state.run_config == {**run_config_of(settings), **MINE}


async def test_a_member_with_the_runs_hashes_trains():
    settings = TrainSettings(model="llama-tiny")
    view, _ = _view({**run_config_of(settings), **MINE}, admin=False)
    await agree_run_identity(view, settings, MINE, wait_s=1)


@pytest.mark.parametrize(
    ("theirs", "message"),
    [
        (
            {**MINE, "data_hash": "c" * 64},
            r"data differs from the run's \(prepared corpus manifest bbbbbbbbbbbb… here, cccccccccccc…",
        ),
        ({**MINE, "model_hash": "d" * 64}, r"model differs from the run's \(model hash aaaaaaaaaaaa… here, "
                                           r"dddddddddddd…"),
        ({**MINE, "data_hash": ""}, r"data differs .* here, none in the run config"),
    ],
)
async def test_a_member_with_another_model_or_corpus_refuses_in_one_line(theirs, message):
    settings = TrainSettings(model="llama-tiny")
    view, _ = _view({**run_config_of(settings), **theirs}, admin=False)
    with pytest.raises(ConfigError, match=message):
        await agree_run_identity(view, settings, MINE, wait_s=1)


async def test_without_published_hashes_a_member_trains_and_says_so(caplog):
    settings = TrainSettings()
    view, _ = _view(run_config_of(settings), admin=False)
    await agree_run_identity(view, settings, MINE, wait_s=0.1)
    assert "without comparing" in caplog.text


def test_an_hf_model_folder_stays_each_members_own_path():
    admin = TrainSettings(model="hf:/data/alice/model")
    mine = TrainSettings(model="hf:/home/bob/model")
    adopted, replaced = apply_run_config(mine, run_config_of(admin))
    assert adopted.model == "hf:/home/bob/model"
    assert "model" not in replaced
    preset, _ = apply_run_config(mine, run_config_of(TrainSettings(model="llama-tiny")))
    assert preset.model == "llama-tiny"  # a preset of the run still wins
