import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from lattica.errors import ConfigError, RemoteProtocolError, StorageError
from lattica.train.engine import checkpoint as checkpoint_mod
from lattica.train.engine.checkpoint import CheckpointStore, verify_weights, weights_hash


def _state(value: float) -> dict:
    return {"step": int(value), "w": torch.full((3, 2), value)}


def test_weights_hash_covers_names_dtypes_shapes_and_bytes():
    base = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    digest = weights_hash(base)
    assert digest == weights_hash(dict(reversed(list(base.items()))))
    assert len(digest) == 64
    variants = [
        {"a2": base["a"], "b": base["b"]},
        {"a": base["a"].to(torch.float64), "b": base["b"]},
        {"a": base["a"].reshape(2, 3), "b": base["b"]},
        {"a": base["a"].clone().index_fill_(0, torch.tensor([5]), 7.0), "b": base["b"]},
    ]
    assert len({weights_hash(v) for v in variants} | {digest}) == 5


def test_weights_hash_of_non_contiguous_equals_contiguous():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert weights_hash({"t": t}) == weights_hash({"t": t.contiguous()})


def test_verify_weights_names_the_peer():
    state = {"w": torch.zeros(2)}
    verify_weights(state, weights_hash(state))
    with pytest.raises(RemoteProtocolError, match="peer QmBad"):
        verify_weights({"w": torch.ones(2)}, weights_hash(state), peer_id="QmBad")


def test_save_keeps_last_k_and_loads_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(step, _state(step))
    assert [s for s, _ in store.checkpoints()] == [20, 30]
    assert store.load_latest()["step"] == 30
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_crash_during_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, _state(1))

    def torn_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_mod.torch, "save", torn_save)
    with pytest.raises(StorageError, match=r"cannot write checkpoint .*step-000000002\.pt: disk full"):
        store.save(2, _state(2))
    assert [s for s, _ in store.checkpoints()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001.pt"]


def test_corrupt_latest_falls_back_to_previous(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, _state(1))
    path = store.save(2, _state(2))
    path.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="unreadable"):
        store.load(path)
    assert store.load_latest()["step"] == 1


def test_empty_store_and_bad_keep(tmp_path):
    assert CheckpointStore(tmp_path / "new").load_latest() is None
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)


def test_discard_after_removes_only_newer_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (10, 20, 30, 40):
        store.save(step, _state(step))
    store.discard_after(20)
    assert [s for s, _ in store.checkpoints()] == [10, 20]
    assert store.load_latest()["step"] == 20


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("wide_umask")
def test_checkpoints_are_private_whatever_the_umask(tmp_path):
    folder = tmp_path / "checkpoints"
    path = CheckpointStore(folder, keep=2).save(1, _state(1))
    assert _mode(folder) == 0o700
    assert _mode(path) == 0o600


@pytest.mark.usefixtures("wide_umask")
def test_opening_a_store_narrows_older_wider_checkpoints(tmp_path):
    path = CheckpointStore(tmp_path / "c", keep=2).save(1, _state(1))
    path.chmod(0o644)
    (tmp_path / "c").chmod(0o755)
    CheckpointStore(tmp_path / "c", keep=2)
    assert _mode(path) == 0o600
    assert _mode(tmp_path / "c") == 0o700


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_opening_a_store_removes_temporaries_of_killed_writers(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, _state(1))
    torn = tmp_path / f".step-000000002.pt.{_dead_pid()}.tmp"
    torn.write_bytes(b"torn")
    writing = tmp_path / f".step-000000003.pt.{os.getpid()}.tmp"  # a live writer's
    writing.write_bytes(b"in progress")
    forgotten = tmp_path / f".step-000000004.pt.{os.getpid()}.tmp"
    forgotten.write_bytes(b"old")
    long_ago = time.time() - checkpoint_mod.STALE_TMP_S - 60
    os.utime(forgotten, (long_ago, long_ago))
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_text("not ours")

    CheckpointStore(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-000000001.pt", writing.name, unrelated.name]
    )
