"""``lattica export`` refuses, in one line, what it cannot export; it rebuilds native models."""

import pytest
import torch

from lattica.errors import ConfigError
from lattica.train.engine.checkpoint import CheckpointStore
from lattica.train.engine.llama import LLAMA_PRESETS, build_llama
from lattica.train.engine.model_spec import resolve_model
from lattica.train.swarm.export import AgreedCheckpoint, agreed_checkpoint, export, rebuild_model
from lattica_lab.daemons import run_cli


def _data_dir_without_claims(tmp_path):
    """A node's data dir with a checkpoint but no published round (a lone, unpublished run)."""
    data_dir = tmp_path / "node"
    store = CheckpointStore(data_dir / "checkpoints")
    model = build_llama(LLAMA_PRESETS["llama-tiny"].with_vocab(50))
    outer = {"round": 1, "step": 4, "completed_rounds": 1, "params": dict(model.named_parameters()), "momentum": {}}
    store.save(4, {"step": 4, "model": model.state_dict(), "outer": outer, "annotations": {}})
    (data_dir / "state-default.log").write_bytes(b"")
    return data_dir


def test_no_agreed_checkpoint_is_one_line_and_writes_nothing(tmp_path):
    data_dir = _data_dir_without_claims(tmp_path)
    with pytest.raises(ConfigError, match=r"no checkpoint .* matches an outer state the swarm published"):
        agreed_checkpoint(data_dir)
    result = run_cli("export", "--data-dir", str(data_dir), "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["node"]


def test_a_data_dir_without_run_state_or_checkpoints_is_one_line(tmp_path):
    result = run_cli("export", "--data-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 1
    assert "holds no run state" in result.stderr
    assert result.stderr.count("\n") == 1


def test_an_existing_out_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="exists; choose another --out or pass --force"):
        export(tmp_path / "nowhere", tmp_path / "out")


def _agreed(model, description):
    return AgreedCheckpoint(
        run_id="r", step=4, round=1, state_hash="0" * 64, model_state=model.state_dict(),
        outer_params={n: p.detach() + 1.0 for n, p in model.named_parameters()}, annotations={"model": description},
    )


def test_the_rebuilt_model_carries_the_outer_weights_not_the_inner_ones():
    spec = resolve_model("llama-tiny", vocab_size=40, seq_len=32)
    model = spec.build(seed=0)
    rebuilt, _ = rebuild_model(_agreed(model, spec.description()))
    for (name, ours), (_, theirs) in zip(model.named_parameters(), rebuilt.named_parameters(), strict=True):
        assert torch.equal(theirs, ours.detach() + 1.0), name
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight  # still tied


def test_a_task_run_without_a_model_description_is_refused():
    model = build_llama(LLAMA_PRESETS["llama-tiny"].with_vocab(40))
    agreed = AgreedCheckpoint(run_id="r", step=1, round=1, state_hash="0" * 64, model_state=model.state_dict(),
                              outer_params={}, annotations={})
    with pytest.raises(ConfigError, match="no model description"):
        rebuild_model(agreed)
