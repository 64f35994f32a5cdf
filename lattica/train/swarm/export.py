"""``lattica export``: the newest outer weights the swarm agreed on, as files other tools load.

Theory of operation
-------------------
A training member keeps its last checkpoints in ``<data dir>/checkpoints`` and publishes, for
its last completed round, the hash of its outer state in the run's replicated state (the
``progress`` records, signed by each member and kept in the data dir's state log). Export reads
both without a daemon:

1. the state log of the run (``crdt/offline.read_snapshot``: signatures checked again) gives
   every member's published ``(round, outer-state hash)``;
2. the checkpoints are tried newest first; the first whose outer state (``outer_state_hash``)
   is a published claim for its round is the agreed one. Its outer weights (the strategy's
   ``params``; for a strategy without outer weights, the model's) are the export;
3. the model is rebuilt from the description kept with every checkpoint (``model_spec``) and
   loaded with those weights, then written into a temporary folder beside ``--out`` that is
   renamed to it when complete:

   - ``--format safetensors``: ``model.safetensors`` (a tied head stored once),
     ``lattica_model.json`` (the model description and where the weights come from: run,
     round, step, hashes) and the data's ``tokenizer.json`` when one was used;
   - ``--format hf``: a folder ``AutoModelForCausalLM.from_pretrained`` loads — a native Llama
     becomes transformers' ``LlamaForCausalLM`` (same parameter names, same arithmetic:
     ``train/engine/llama.py``), an ``hf:`` model its own type — with ``tokenizer.json`` and a
     ``tokenizer_config.json`` for ``AutoTokenizer``. The byte-level GPT presets have no
     transformers counterpart here: safetensors only.

No agreed checkpoint (no checkpoints, no published claim matching one), a checkpoint without a
model description (a ``--task`` run) and an existing ``--out`` without ``force`` are one-line
``ConfigError``s; nothing is left half-written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lattica.crdt.offline import read_snapshot, stored_runs
from lattica.errors import ConfigError
from lattica.train.engine import hf
from lattica.train.engine.checkpoint import CheckpointStore, weights_hash
from lattica.train.engine.llama import LlamaConfig, build_llama
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.outer_state import outer_state_hash
from lattica.train.engine.prepare import replace_folder

FORMATS = ("safetensors", "hf")
DESCRIPTION_NAME = "lattica_model.json"


@dataclass(frozen=True)
class AgreedCheckpoint:
    run_id: str
    step: int
    round: int
    state_hash: str  # of the outer state, as the members published it
    model_state: dict[str, torch.Tensor]  # the checkpoint's model weights and buffers
    outer_params: dict[str, torch.Tensor]  # the agreed outer weights (empty: the model's are)
    annotations: Mapping[str, Any]


def agreed_checkpoint(data_dir: Path, run_id: str | None = None) -> AgreedCheckpoint:
    """The newest local checkpoint whose outer state a member published (module docstring)."""
    run = _run_of(data_dir, run_id)
    claims = _published_claims(data_dir, run)
    folder = data_dir / "checkpoints"
    if not folder.is_dir():
        raise ConfigError(f"{data_dir} holds no checkpoints: nothing to export")
    store = CheckpointStore(folder)
    for step, path in reversed(store.checkpoints()):
        try:
            state = store.load(path)
        except ConfigError:
            continue
        outer = state.get("outer")
        if not isinstance(outer, dict):
            continue
        rnd = outer.get("completed_rounds", outer.get("round"))
        digest = outer_state_hash(outer)
        if type(rnd) is int and (rnd, digest) in claims:
            params = outer.get("params")
            return AgreedCheckpoint(
                run_id=run, step=step, round=rnd, state_hash=digest,
                model_state=dict(state.get("model", {})),
                outer_params=dict(params) if isinstance(params, dict) else {},
                annotations=state.get("annotations") or {},
            )
    raise ConfigError(
        f"no checkpoint in {folder} matches an outer state the swarm published for run {run!r}; "
        "export needs a completed round that the members agreed on"
    )


def _run_of(data_dir: Path, run_id: str | None) -> str:
    runs = stored_runs(data_dir)
    if run_id is not None:
        if run_id not in runs:
            raise ConfigError(f"{data_dir} holds no state of run {run_id!r}")
        return run_id
    if not runs:
        raise ConfigError(f"{data_dir} holds no run state (is it a node's --data-dir?)")
    if len(runs) > 1:
        raise ConfigError(f"{data_dir} holds the state of runs {', '.join(runs)}; choose one with --run-id")
    return runs[0]


def _published_claims(data_dir: Path, run_id: str) -> set[tuple[int, str]]:
    progress = read_snapshot(data_dir, run_id).get("progress", {})
    claims = set()
    for record in progress.values() if isinstance(progress, dict) else ():
        rnd, digest = record.get("round"), record.get("weights_hash")
        if type(rnd) is int and isinstance(digest, str):
            claims.add((rnd, digest))
    return claims


# --------------------------------------------------------------------------- the model


def rebuild_model(agreed: AgreedCheckpoint) -> tuple[nn.Module, dict[str, Any]]:
    """The checkpoint's model with the agreed outer weights, and its description."""
    description = agreed.annotations.get("model")
    if not isinstance(description, dict):
        raise ConfigError(
            "the checkpoint holds no model description (a --task run, or one of an older version): "
            "export knows built-in and hf: models only"
        )
    model = _empty_model(description)
    try:
        model.load_state_dict(agreed.model_state)
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in agreed.outer_params.items():
                named[name].copy_(tensor)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"the checkpoint's weights do not fit its model description: {exc}") from None
    return model, description


def _empty_model(description: Mapping[str, Any]) -> nn.Module:
    family, config = description.get("family"), description.get("config")
    if not isinstance(config, dict):
        raise ConfigError("the checkpoint's model description has no config")
    try:
        if family == "llama":
            return build_llama(LlamaConfig(**config))
        if family == "gpt":
            return build_model(GPTConfig(**config))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the checkpoint's model description is not valid: {exc}") from None
    if family == "hf":
        transformers = _transformers()
        built: nn.Module = transformers.AutoModelForCausalLM.from_config(hf.hf_config_object(config))
        return built.float()
    raise ConfigError(f"the checkpoint's model family {family!r} is unknown")


def hf_llama_config(config: LlamaConfig) -> Any:
    """transformers' ``LlamaConfig`` of a native Llama: the same model."""
    transformers = _transformers()
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim, max_position_embeddings=config.context, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tied_head, hidden_act="silu",
        attention_bias=False, mlp_bias=False,
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("this export needs transformers: pip install 'lattica[hf]'") from None
    return transformers


# --------------------------------------------------------------------------- writing


def export(
    data_dir: Path, out: Path, *, fmt: str = "safetensors", run_id: str | None = None, force: bool = False,
) -> tuple[AgreedCheckpoint, list[str]]:
    """Write the agreed weights of ``data_dir`` into ``out``; the checkpoint used and notes
    for the user (e.g. a tokenizer that is gone)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; choose another --out or pass --force to replace it")
    agreed = agreed_checkpoint(data_dir, run_id)
    model, description = rebuild_model(agreed)
    if fmt == "hf" and description.get("family") == "gpt":
        raise ConfigError("the byte-level GPT presets have no transformers counterpart: use --format safetensors")
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    notes: list[str] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        if fmt == "hf":
            _write_hf(model, description, staging)
        else:
            _write_safetensors(model, staging)
        notes += _copy_tokenizer(agreed.annotations, staging, hf_format=fmt == "hf")
        provenance = {
            "model": description, "run_id": agreed.run_id, "round": agreed.round, "step": agreed.step,
            "outer_state_hash": agreed.state_hash, "weights_hash": weights_hash(model.state_dict()),
        }
        (staging / DESCRIPTION_NAME).write_text(json.dumps(provenance, indent=1, sort_keys=True) + "\n")
        replace_folder(staging, out)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return agreed, notes


def _write_safetensors(model: nn.Module, folder: Path) -> None:
    """Every tensor of the state dict once: a tied head is stored under the embedding's name
    (the first name of shared storage), as transformers stores tied weights."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("safetensors export needs safetensors: pip install 'lattica[hf]'") from None
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.numel() and tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_hf(model: nn.Module, description: Mapping[str, Any], folder: Path) -> None:
    if description.get("family") == "llama":
        transformers = _transformers()
        native = model
        model = transformers.LlamaForCausalLM(hf_llama_config(LlamaConfig(**description["config"])))
        model.load_state_dict(native.state_dict())
    model.save_pretrained(str(folder))  # type: ignore[operator]  # a transformers PreTrainedModel


def _copy_tokenizer(annotations: Mapping[str, Any], folder: Path, *, hf_format: bool) -> list[str]:
    source = annotations.get("tokenizer")
    if not isinstance(source, str):
        return []
    path = Path(source)
    if not path.is_file():
        return [f"the run's tokenizer {path} is gone: exported without it"]
    shutil.copyfile(path, folder / "tokenizer.json")
    if hf_format:
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return []
