"""Your model, your data, your weights back — across real ``lattica join --train`` daemons.

A BPE tokenizer trained here on stdlib sources (nothing downloaded), ``lattica data prepare``,
two daemons on ``llama-tiny`` and the prepared corpus finish two rounds with identical outer
weights, and ``lattica export --format hf`` writes a folder that transformers loads and that
reproduces the trainer's logits. An ``hf:`` model from a tiny local config does the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lattica_lab.bpe import stdlib_texts
from lattica_lab.daemons import DaemonProcess, run_cli
from lattica_lab.training_daemons import TRAIN_ENV, final_hashes, train_args, wait_done

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'lattica[hf]')")

INNER_STEPS = 4
ROUNDS = 2


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    try:
        yield started
    finally:
        for daemon in started:
            daemon.kill()


def _prepared_corpus(tmp_path: Path, tokenizer: Path) -> Path:
    texts = tmp_path / "texts"
    texts.mkdir(parents=True)
    for i, text in enumerate(stdlib_texts(40)):
        (texts / f"doc{i:03d}.py").write_text(text)
    out = tmp_path / "prepared"
    result = run_cli("data", "prepare", str(texts), "--tokenizer", str(tokenizer), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    return out


def _start_two(tmp_path: Path, daemons: list[DaemonProcess], model_args: tuple[str, ...]) -> list[DaemonProcess]:
    args = (*train_args("diloco", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=2), *model_args)
    first = DaemonProcess(tmp_path / "a", extra_args=args, env=TRAIN_ENV).start()
    daemons.append(first)
    first.wait_ready(60)
    second = DaemonProcess(tmp_path / "b", peers=(first.addr,), extra_args=args, env=TRAIN_ENV).start()
    daemons.append(second)
    second.wait_ready(60)
    return [first, second]


def test_llama_on_prepared_data_trains_identically_and_exports_to_transformers(tmp_path, daemons, bpe_tokenizer):
    data = _prepared_corpus(tmp_path, bpe_tokenizer)
    pair = _start_two(tmp_path, daemons, ("--model", "llama-tiny", "--data", str(data)))
    infos = wait_done(pair, timeout=150)
    assert [i["rounds_completed"] for i in infos] == [ROUNDS, ROUNDS]
    assert len(final_hashes(pair, rounds=ROUNDS)) == 1
    assert all(i.get("val_bpb") is not None for i in infos), infos

    out = tmp_path / "exported"
    result = run_cli("export", "--data-dir", str(pair[1].data_dir), "--out", str(out), "--format", "hf", timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"round {ROUNDS}" in result.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert (out / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("def f(x):\n    return x") == tokenizer.encode("def f(x):\n    return x")

    # the trainer's model with the weights the swarm agreed on: the checkpoint of the last round
    from lattica.train.swarm.export import agreed_checkpoint, rebuild_model

    agreed = agreed_checkpoint(pair[0].data_dir)
    assert agreed.round == ROUNDS
    trained, description = rebuild_model(agreed)
    assert description["family"] == "llama"
    batch = torch.randint(0, description["config"]["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(trained.eval()(batch), exported(input_ids=batch).logits, atol=1e-5)

    plain = tmp_path / "plain"
    result = run_cli("export", "--data-dir", str(pair[0].data_dir), "--out", str(plain), timeout=120)
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    stored = load_file(plain / "model.safetensors")
    assert all(torch.equal(stored[name], tensor) for name, tensor in trained.state_dict().items() if name in stored)
    assert "model.embed_tokens.weight" in stored  # the tied head is stored once
    provenance = json.loads((plain / "lattica_model.json").read_text())
    assert provenance["round"] == ROUNDS
    assert provenance["model"] == description

    again = run_cli("export", "--data-dir", str(pair[1].data_dir), "--out", str(out), timeout=60)
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1
    assert "exists" in again.stderr


def _tiny_hf_model(folder: Path) -> Path:
    """A tiny Llama-architecture config, written by the test (no hub, no download)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    config.save_pretrained(folder)
    return folder


def test_an_hf_model_from_a_local_config_trains_identically_on_two_daemons(tmp_path, daemons):
    model = _tiny_hf_model(tmp_path / "hf-model")
    pair = _start_two(tmp_path, daemons, ("--model", f"hf:{model}"))
    infos = wait_done(pair, timeout=150)
    assert [i["rounds_completed"] for i in infos] == [ROUNDS, ROUNDS]
    assert len(final_hashes(pair, rounds=ROUNDS)) == 1
    out = tmp_path / "exported"
    result = run_cli("export", "--data-dir", str(pair[0].data_dir), "--out", str(out), "--format", "hf", timeout=120)
    assert result.returncode == 0, result.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.hidden_size == 32
    assert json.loads((out / "lattica_model.json").read_text())["round"] == ROUNDS


def test_a_member_with_another_corpus_refuses_to_train_naming_the_difference(tmp_path, daemons, bpe_tokenizer):
    ours = _prepared_corpus(tmp_path / "ours", bpe_tokenizer)
    theirs = tmp_path / "theirs"
    # the same texts and tokenizer, another split: another corpus
    result = run_cli("data", "prepare", str(tmp_path / "ours" / "texts"), "--tokenizer", str(bpe_tokenizer),
                     "--out", str(theirs), "--val-fraction", "0.3", timeout=60)
    assert result.returncode == 0, result.stderr
    args = (*train_args("diloco", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=2), "--model", "llama-tiny")
    first = DaemonProcess(tmp_path / "a", extra_args=(*args, "--data", str(ours)), env=TRAIN_ENV).start()
    daemons.append(first)
    first.wait_ready(60)
    second = DaemonProcess(
        tmp_path / "b", peers=(first.addr,), extra_args=(*args, "--data", str(theirs)), env=TRAIN_ENV,
    ).start()
    daemons.append(second)
    second.wait_ready(60)
    from lattica_lab.daemons import wait_for
    from lattica_lab.training_daemons import training

    failed = wait_for(lambda: training(second) if training(second)["phase"] == "failed" else None, timeout=90)
    assert failed, training(second)
    assert "data differs from the run's (prepared corpus manifest" in failed["error"]
