"""Which model a run's ``model`` setting means, sized for its data, and its hash.

Three families share one interface (``ModelSpec``): the byte-level GPT presets
(``train/engine/model.py``: ``tiny`` …), the Llama-style presets (``train/engine/llama.py``: ``llama-tiny`` …)
and Hugging Face models from a local folder (``hf:<dir>``, ``train/engine/hf.py``). A spec is resolved
from the setting, the data's vocabulary and the run's ``seq_len``:

- native presets take the vocabulary of the data's tokenizer (a Llama exactly that; a GPT keeps
  its 256 bytes unless the data's vocabulary is larger) and a context of at most ``seq_len``;
- an ``hf:`` model keeps its own vocabulary, which must hold every id of the data's tokenizer.

``build(seed)`` gives the same weights for the same seed on every machine. ``description()`` is
plain JSON that identifies the model — its family, its full config, and for ``hf:`` models the
init mode (and weights' hashes); its sha256 (``model_hash``) is what the run config carries, so
a member with another model refuses to train, and it is kept with every checkpoint, from which
``lattica export`` rebuilds the model's config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lattica.errors import ConfigError
from lattica.train.engine import hf
from lattica.train.engine.llama import LLAMA_PRESETS, LlamaConfig, build_llama, count_llama_parameters
from lattica.train.engine.model import PRESETS, GPTConfig, build_model, lm_loss

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(x), y)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    family: str  # "gpt", "llama" or "hf"
    vocab_size: int
    context: int
    native: GPTConfig | LlamaConfig | None = None
    hf_dir: Path | None = None
    init: str = "seed"
    hf_description: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def build(self, *, seed: int) -> nn.Module:
        if isinstance(self.native, LlamaConfig):
            return build_llama(self.native, seed=seed)
        if isinstance(self.native, GPTConfig):
            return build_model(self.native, seed=seed)
        assert self.hf_dir is not None
        return hf.build_hf_model(self.hf_dir, init=self.init, seed=seed)

    @property
    def loss_fn(self) -> LossFn:
        return hf.hf_loss if self.family == "hf" else _language_model_loss

    def description(self) -> dict[str, Any]:
        if self.native is not None:
            return {"family": self.family, "preset": self.name, "config": dataclasses.asdict(self.native)}
        return dict(self.hf_description)

    def model_hash(self) -> str:
        blob = json.dumps(self.description(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def model_names() -> list[str]:
    """The built-in presets, GPT then Llama."""
    return [*PRESETS, *LLAMA_PRESETS]


def model_family(name: str) -> str | None:
    """The family of the ``model`` setting ``name`` ("gpt", "llama" or "hf") without building or
    reading anything; None for a name that is none of them (``check_model`` refuses it)."""
    if hf.is_hf_model(name):
        return "hf"
    if name in LLAMA_PRESETS:
        return "llama"
    return "gpt" if name in PRESETS else None


def check_model(name: str, init: str) -> None:
    """Start-up check of the ``model`` and ``init`` settings (no model is built)."""
    if hf.is_hf_model(name):
        hf.read_hf_config(hf.hf_directory(name))
        return
    if name not in PRESETS and name not in LLAMA_PRESETS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(model_names())} or hf:<local dir>")
    if init != "seed":
        raise ConfigError(f'train.init = "{init}" is for hf: models; a built-in preset starts from the seed')


def resolve_model(name: str, *, vocab_size: int, seq_len: int, init: str = "seed") -> ModelSpec:
    """The spec of ``name`` for data of ``vocab_size`` tokens and sequences of ``seq_len``."""
    check_model(name, init)
    if name in LLAMA_PRESETS:
        llama = LLAMA_PRESETS[name]
        llama = dataclasses.replace(llama, vocab_size=vocab_size, context=min(seq_len, llama.context))
        return ModelSpec(name=name, family="llama", vocab_size=vocab_size, context=llama.context, native=llama)
    if name in PRESETS:
        gpt = PRESETS[name]
        gpt = dataclasses.replace(gpt, vocab_size=max(vocab_size, gpt.vocab_size), context=min(seq_len, gpt.context))
        return ModelSpec(name=name, family="gpt", vocab_size=gpt.vocab_size, context=gpt.context, native=gpt)
    directory = hf.hf_directory(name)
    config = hf.read_hf_config(directory)
    model_vocab = hf.hf_vocab_size(config)
    if vocab_size > model_vocab:
        raise ConfigError(
            f"the data's tokenizer has {vocab_size} tokens, more than the vocabulary of {name} ({model_vocab}); "
            "prepare the data with the model's own tokenizer"
        )
    return ModelSpec(
        name=name, family="hf", vocab_size=model_vocab, context=hf.hf_context(config, seq_len), hf_dir=directory,
        init=init, hf_description=hf.model_description(directory, config, init),
    )


def gpt_parameter_count(config: GPTConfig) -> int:
    """The parameter count of a GPT preset without building it (the head is tied)."""
    d = config.d_model
    per_layer = 12 * d * d + 13 * d
    return (config.vocab_size + config.context) * d + config.n_layer * per_layer + 2 * d


def preset_table(vocab_size: int = 32_000) -> list[tuple[str, int]]:
    """Every built-in preset with its parameter count: a Llama at ``vocab_size`` tokens, a GPT at
    its 256 bytes."""
    rows = [(name, gpt_parameter_count(config)) for name, config in PRESETS.items()]
    return rows + [(name, count_llama_parameters(c.with_vocab(vocab_size))) for name, c in LLAMA_PRESETS.items()]


def preset_help() -> str:
    """The ``--model`` help of ``lattica join`` (kept there as text: the CLI starts without torch)."""
    counts = dict(preset_table())
    gpt = ", ".join(f"{n} ({_short(counts[n])})" for n in PRESETS)
    llama = ", ".join(f"{n} ({_short(counts[n])})" for n in LLAMA_PRESETS)
    return (f"GPT presets (byte vocabulary): {gpt}; Llama presets (parameters at a 32k vocabulary; "
            f"the vocabulary is the data's): {llama}; or hf:<local dir>")


def _short(count: int) -> str:
    if count >= 1_000_000_000:
        return f"{count / 1e9:.2f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.1f}M"
    return f"{count / 1e3:.0f}k"
