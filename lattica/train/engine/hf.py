"""Hugging Face models: ``model = "hf:<local dir>"`` builds ``AutoModelForCausalLM`` from the dir.

The folder is what transformers writes with ``save_pretrained`` (or ``huggingface-cli download
--local-dir``): a ``config.json`` and, to continue from them, the weights. ``init = "seed"``
builds the architecture with weights drawn from the run's seed (transformers' own initialisation
under a forked, seeded torch generator, so every member draws the same); ``init = "weights"``
loads the folder's weights (continued pretraining, fine-tuning). Nothing is downloaded at run
time: the folder must exist locally, and a hub id without a local copy is a one-line error
that says how to fetch it once. Model code from the folder is never run (no
``trust_remote_code``): the architecture must be one transformers ships.

The model is trained as it is: its forward takes ``input_ids`` and returns an output whose
``logits`` the loss uses (``hf_loss``), and its parameter names stay transformers' — so
``lattica export --format hf`` writes a folder of the same model type.

The model hash every member compares (``model_description``) covers the config (less the keys
transformers writes about itself), the init mode, and with ``init = "weights"`` the sha256 of
every weights file — read once at start-up, in 1 MiB pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lattica.errors import ConfigError
from lattica.train.engine.model import lm_loss
from lattica.train.engine.tokenized import file_sha256

PREFIX = "hf:"
INITS = ("seed", "weights")
MAX_CONFIG_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_VOLATILE_KEYS = ("transformers_version", "torch_dtype", "dtype", "architectures", "auto_map")


def is_hf_model(name: str) -> bool:
    return name.startswith(PREFIX)


def hf_directory(name: str) -> Path:
    """The local folder named by ``hf:<dir>``, with its ``config.json``; a one-line error for
    anything else (a hub id without a local copy among them)."""
    text = name.removeprefix(PREFIX)
    path = Path(text).expanduser()
    if not text:
        raise ConfigError("model 'hf:' needs a folder: hf:<local dir with config.json>")
    if not path.exists():
        raise ConfigError(
            f"model {name!r}: no local folder {text!r}; Lattica downloads nothing at run time — fetch it once "
            f"(huggingface-cli download {text} --local-dir DIR) and use hf:DIR"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {name!r}: {path} has no config.json (a transformers model folder)")
    return path


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ConfigError(f"{path} is not valid JSON") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{path} must be a JSON object with a model_type")
    return config


def hf_vocab_size(config: dict[str, Any]) -> int:
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConfigError(f"the model config's vocab_size must be a positive integer, got {vocab!r}")
    return vocab


def hf_context(config: dict[str, Any], seq_len: int) -> int:
    """Sequences of ``seq_len`` tokens, at most the model's positions."""
    for key in ("max_position_embeddings", "n_positions"):
        limit = config.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return min(seq_len, limit)
    return seq_len


def weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def model_description(directory: Path, config: dict[str, Any], init: str) -> dict[str, Any]:
    """What identifies the model (hashed for the run config; kept with every checkpoint)."""
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS and not k.startswith("_")}
    description: dict[str, Any] = {"family": "hf", "config": stable, "init": init}
    if init == "weights":
        files = weight_files(directory)
        if not files:
            raise ConfigError(f"init = \"weights\": {directory} holds no weights (*.safetensors, *.bin)")
        description["weights"] = {p.name: file_sha256(p) for p in files}
    return description


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf: models need transformers: pip install 'lattica[hf]'") from None
    return transformers


def build_hf_model(directory: Path, *, init: str, seed: int) -> nn.Module:
    """``AutoModelForCausalLM`` of ``directory``: seeded fresh weights, or the folder's."""
    transformers = _transformers()
    try:
        if init == "weights":
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, trust_remote_code=False,
            )
        else:
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"cannot build the model of {directory}: {_first_line(exc)}") from None
    model.float()  # trained in fp32 (autocast on a GPU), whatever dtype the folder stores
    built: nn.Module = model
    return built


def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a transformers causal LM (its ``logits``) against ``y``."""
    return lm_loss(model(input_ids=x).logits, y)


def hf_config_object(config: dict[str, Any]) -> Any:
    """A transformers config object of the dict ``config`` (``model_type`` inside)."""
    transformers = _transformers()
    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(config["model_type"], **rest)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the model config cannot be read by transformers: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).strip().splitlines()[0]
