"""Model settings: presets, hf: folders (nothing downloaded), vocabularies, the model hash."""

import json

import pytest
import torch

from lattica.cli.main import MODEL_HELP
from lattica.config import TrainSettings
from lattica.errors import ConfigError
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.model_spec import check_model, preset_help, resolve_model
from lattica.train.settings.settings_check import check_settings
from lattica_lab.daemons import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'lattica[hf]')")


def _hf_folder(path, *, vocab=256, weights=False):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    if weights:
        torch.manual_seed(123)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def test_join_help_lists_every_preset_with_its_parameter_count():
    assert preset_help() == MODEL_HELP


def test_llama_takes_the_datas_vocabulary_and_at_most_seq_len_positions():
    spec = resolve_model("llama-tiny", vocab_size=1000, seq_len=64)
    assert spec.vocab_size == 1000
    assert spec.context == 64
    model = spec.build(seed=0)
    assert model(torch.randint(0, 1000, (1, 64))).shape == (1, 64, 1000)
    other = resolve_model("llama-tiny", vocab_size=1001, seq_len=64)
    assert spec.model_hash() != other.model_hash()  # the vocabulary is part of the model


def test_unknown_preset_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"unknown model 'llama-7b'; choose one of tiny, .*llama-1b or hf:"):
        check_model("llama-7b", "seed")


def test_a_hub_id_without_a_local_copy_is_refused_without_downloading():
    with pytest.raises(ConfigError, match=r"downloads nothing at run time .* --local-dir DIR"):
        check_model("hf:meta-llama/Llama-3.2-1B", "seed")


def test_hf_seed_init_is_the_same_for_the_same_seed(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    a = resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32).build(seed=5)
    b = resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32).build(seed=5)
    c = resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32).build(seed=6)
    assert weights_hash(a.state_dict()) == weights_hash(b.state_dict()) != weights_hash(c.state_dict())


def test_hf_weights_init_loads_the_folders_weights_and_hashes_them(tmp_path):
    folder = _hf_folder(tmp_path / "m", weights=True)
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder)
    spec = resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32, init="weights")
    model = spec.build(seed=99)
    assert weights_hash(model.state_dict()) == weights_hash(saved.state_dict())
    assert set(spec.description()["weights"]) == {"model.safetensors"}
    assert spec.model_hash() != resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32).model_hash()


def test_a_tokenizer_larger_than_the_hf_models_vocabulary_is_refused(tmp_path):
    folder = _hf_folder(tmp_path / "m", vocab=100)
    with pytest.raises(ConfigError, match=r"300 tokens, more than the vocabulary of hf:.* \(100\)"):
        resolve_model(f"hf:{folder}", vocab_size=300, seq_len=32)


def test_init_weights_without_weights_and_init_for_a_preset_are_refused(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    with pytest.raises(ConfigError, match="holds no weights"):
        resolve_model(f"hf:{folder}", vocab_size=256, seq_len=32, init="weights")
    with pytest.raises(ConfigError, match="is for hf: models"):
        check_model("llama-tiny", "weights")


def test_a_folder_without_config_json_and_a_malformed_config_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        check_model(f"hf:{tmp_path / 'empty'}", "seed")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object with a model_type"):
        check_model(f"hf:{tmp_path / 'bad'}", "seed")


def test_spes_trains_its_own_experts_not_a_llama():
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_settings(TrainSettings(strategy="spes", model="llama-tiny"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "llama-7b"), "unknown model 'llama-7b'"),
        (("--model", "hf:some-org/some-model"), "downloads nothing at run time"),
        (("--init", "weights"), "is for hf: models"),
    ],
)
def test_join_refuses_bad_model_settings_in_one_line(tmp_path, args, message):
    result = run_cli(
        "join", "--data-dir", str(tmp_path / "node"), "--train", "--metrics-addr", "off", *args, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert message in result.stderr


def test_the_cli_parser_with_the_new_commands_starts_without_torch():
    import subprocess
    import sys

    code = "import sys, lattica.cli.main as m; m.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


def test_join_refuses_a_tokenizer_larger_than_the_hf_models_vocabulary(tmp_path, bpe_tokenizer):
    from lattica.train.engine.prepare import PrepareConfig, prepare

    source = tmp_path / "a.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(30)))
    prepare(PrepareConfig(inputs=(source,), tokenizer=bpe_tokenizer, out=tmp_path / "data"))  # 384 tokens
    folder = _hf_folder(tmp_path / "m", vocab=100)
    result = run_cli("join", "--data-dir", str(tmp_path / "node"), "--train", "--metrics-addr", "off",
                     "--model", f"hf:{folder}", "--data", str(tmp_path / "data"), timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "has 384 tokens, more than the vocabulary of hf:" in result.stderr
