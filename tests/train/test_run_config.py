"""The run config: an admin publishes the run-wide settings, every member trains with them."""

from __future__ import annotations

import pytest

from lattica.config import TrainSettings
from lattica.crdt.config import StateConfig
from lattica.errors import ConfigError
from lattica.train.swarm.membership import MembershipView
from lattica.train.swarm.run_config import RUN_WIDE, apply_run_config, run_config_of
from lattica_lab.daemons import DaemonProcess, cli_json, wait_for

TRAIN_ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "OMP_NUM_THREADS": "1",
}


def test_run_wide_settings_are_settings():
    names = {f for f in TrainSettings.__dataclass_fields__}
    assert set(RUN_WIDE) <= names
    assert {"data", "task", "device", "min_peers"}.isdisjoint(RUN_WIDE)  # each member's own


def test_a_published_config_wins_and_says_what_it_replaced():
    admin = TrainSettings(inner_steps=5, rounds=2, outer_lr=0.5, seed=3)
    mine = TrainSettings(inner_steps=7, rounds=4, outer_momentum=0.3, data="/my/corpus", batch_size=2)
    adopted, replaced = apply_run_config(mine, run_config_of(admin))
    assert (adopted.inner_steps, adopted.rounds, adopted.outer_lr, adopted.seed) == (5, 2, 0.5, 3)
    assert adopted.outer_momentum is None  # left out by the admin: the strategy default
    assert (adopted.data, adopted.batch_size) == ("/my/corpus", 2)  # our own
    assert replaced == {"inner_steps": 7, "rounds": 4, "outer_lr": None, "outer_momentum": 0.3, "seed": 0}


def test_a_bad_published_config_is_a_config_error():
    with pytest.raises(ConfigError, match="rounds"):
        apply_run_config(TrainSettings(), {"rounds": 0})


def _trainer(path, *, rounds, inner_steps, peers=()):
    args = (
        "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info",
        "--rounds", str(rounds), "--inner-steps", str(inner_steps), "--min-peers", "2",
    )
    return DaemonProcess(path, peers=peers, extra_args=args, env=TRAIN_ENV)


def test_a_joiner_trains_with_the_admins_run_config(tmp_path):
    admin = _trainer(tmp_path / "admin", rounds=2, inner_steps=4).start()
    daemons = [admin]
    try:
        admin.wait_ready(timeout=60)
        joiner = _trainer(tmp_path / "joiner", rounds=5, inner_steps=6, peers=(admin.addr,)).start()
        daemons.append(joiner)
        joiner.wait_ready(timeout=60)

        def done(daemon):
            info = daemon.call("status").get("training") or {}
            assert info.get("phase") != "failed", info
            return info if info.get("phase") == "done" else None

        for daemon in daemons:
            info = wait_for(lambda d=daemon: done(d), timeout=240)
            assert info["rounds_target"] == 2
            assert info["rounds_completed"] == 2
        state = cli_json("state", "--data-dir", str(joiner.data_dir))
        assert state["config"]["rounds"] == 2
        assert state["config"]["inner_steps"] == 4
        assert "run config: rounds = 2 (this node's 5 is overridden)" in joiner.log()
    finally:
        for daemon in daemons:
            daemon.stop()


class _MemoryRunState:
    """An in-memory stand-in for the replicated state's run-config part."""

    def __init__(self, config, *, admin: bool) -> None:
        self.run_config, self.admin = dict(config), admin
        self.config = StateConfig()

    def snapshot(self):
        return {"config": dict(self.run_config), "members": {}}

    def live_members(self):
        return []

    async def wait_changed(self) -> None:
        raise AssertionError("a published config needs no waiting")

    async def set_run_config(self, config) -> None:
        from lattica.errors import LocalProtocolError

        if not self.admin:
            raise LocalProtocolError("only admin keys may change the run config")
        self.run_config = dict(config)


async def test_an_admin_restarted_with_other_run_wide_settings_updates_the_config():
    from lattica.train.swarm.run_config import agree_run_config

    state = _MemoryRunState(run_config_of(TrainSettings(rounds=200)), admin=True)
    extended = TrainSettings(rounds=7)
    assert await agree_run_config(MembershipView(state, peer_id="me"), extended, wait_s=1) == extended
    assert state.run_config["rounds"] == 7


async def test_a_member_that_is_no_admin_follows_the_published_config():
    from lattica.train.swarm.run_config import agree_run_config

    state = _MemoryRunState(run_config_of(TrainSettings(rounds=200)), admin=False)
    adopted = await agree_run_config(MembershipView(state, peer_id="me"), TrainSettings(rounds=7), wait_s=1)
    assert adopted.rounds == 200
    assert state.run_config["rounds"] == 200
