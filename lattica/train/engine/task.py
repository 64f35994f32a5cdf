"""What to train: a model, its batches and its loss — built in, or from a user entry point.

``--task package.module:function`` names a function that takes a ``TaskContext`` (which shard
and seed this peer uses) and returns a ``Task``. Everything about the entry point is checked
and reported as one clear ``ConfigError``: a malformed spec, a module that fails to import, a
missing or non-callable attribute, a function that raises, or a return value of the wrong shape.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lattica.errors import ConfigError
from lattica.train.engine.data import (
    BatchConfig,
    BatchSampler,
    DataConfig,
    load_corpus,
    validation_batches,
)
from lattica.train.engine.llama import LlamaConfig, build_llama
from lattica.train.engine.model import GPTConfig, build_model, lm_loss
from lattica.train.engine.model_spec import resolve_model

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model(x)`` against ``y`` (nats per token)."""
    return lm_loss(model(x), y)


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """Given to a task function: which part of the data this peer trains on."""

    shard_index: int = 0
    num_shards: int = 1
    seed: int = 0


@dataclass(kw_only=True)
class Task:
    """A model with its data and loss. ``train_batches`` yields ``(x, y)`` forever."""

    model: nn.Module
    train_batches: Iterator[Batch]
    loss_fn: LossFn = language_model_loss
    val_batches: Sequence[Batch] = ()
    optimizer: torch.optim.Optimizer | None = None
    description: str = ""
    data_hash: str = ""
    sampler: BatchSampler | None = field(default=None, repr=False)
    # built-in tasks: what identifies the model (``model_spec``), its sha256, and the data's
    # UTF-8 bytes per token (validation bits per byte) and tokenizer file
    model_description: dict[str, Any] | None = None
    model_hash: str = ""
    bytes_per_token: float | None = None
    tokenizer: Path | None = None


def builtin_task(
    *,
    model: GPTConfig | LlamaConfig | str = "tiny",
    data: DataConfig | None = None,
    batch_size: int = 8,
    context: TaskContext | None = None,
    model_seed: int = 0,
    eval_batches: int = 8,
    seq_len: int | None = None,
    init: str = "seed",
) -> Task:
    """A built-in language model on a corpus (default: the byte-level GPT ``tiny`` on the Python
    standard library). ``model`` is a config, or a preset name or ``hf:<dir>`` resolved for the
    data's vocabulary and ``seq_len`` (``model_spec``)."""
    ctx = context or TaskContext()
    corpus = load_corpus(data or DataConfig())
    if isinstance(model, str):
        spec = resolve_model(model, vocab_size=corpus.vocab_size, seq_len=seq_len or 1 << 30, init=init)
        network, length = spec.build(seed=model_seed), spec.context
        description, model_hash, loss_fn = spec.description(), spec.model_hash(), spec.loss_fn
    else:
        network, length = _native_model(model, corpus.vocab_size, model_seed), model.context
        description, model_hash, loss_fn = None, "", language_model_loss
    sampler = BatchSampler(
        corpus.train,
        BatchConfig(
            batch_size=batch_size,
            context=length,
            seed=ctx.seed,
            shard_index=ctx.shard_index,
            num_shards=ctx.num_shards,
        ),
    )
    val = validation_batches(
        corpus.val, batch_size=batch_size, context=length, max_batches=eval_batches
    )
    return Task(
        model=network,
        train_batches=iter(sampler),
        loss_fn=loss_fn,
        val_batches=val,
        description=corpus.description,
        data_hash=corpus.content_hash,
        sampler=sampler,
        model_description=description,
        model_hash=model_hash,
        bytes_per_token=corpus.bytes_per_token,
        tokenizer=corpus.tokenizer,
    )


def _native_model(config: GPTConfig | LlamaConfig, vocab_size: int, seed: int) -> nn.Module:
    if isinstance(config, LlamaConfig):
        return build_llama(config.with_vocab(vocab_size), seed=seed)
    if vocab_size > config.vocab_size:
        config = GPTConfig(**{**config.__dict__, "vocab_size": vocab_size})
    return build_model(config, seed=seed)


def load_task(spec: str, context: TaskContext) -> Task:
    """Import ``package.module:function``, call it with ``context`` and validate the ``Task``."""
    function = resolve_task(spec)
    try:
        task = function(context)
    except ConfigError:
        raise
    except Exception as exc:  # the user's task function may raise anything
        raise ConfigError(f"task {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    return validate_task(task, spec)


def resolve_task(spec: str) -> Callable[[TaskContext], Task]:
    """The task function named by ``spec``, imported but not called (``ConfigError`` if none)."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ConfigError(f"task {spec!r} must look like 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - importing the task module runs user code, which may raise anything
        raise ConfigError(f"cannot import task module {module_name!r}: {exc}") from None
    function: Callable[[TaskContext], Task] | None = getattr(module, attr, None)
    if function is None:
        raise ConfigError(f"task module {module_name!r} has no attribute {attr!r}")
    if not callable(function):
        raise ConfigError(f"task {spec!r} is not callable")
    return function


def validate_task(task: object, spec: str = "task") -> Task:
    if not isinstance(task, Task):
        raise ConfigError(f"{spec} must return lattica.train.engine.task.Task, got {type(task).__name__}")
    if not isinstance(task.model, nn.Module):
        raise ConfigError(f"{spec}: Task.model must be a torch.nn.Module")
    if not any(p.requires_grad for p in task.model.parameters()):
        raise ConfigError(f"{spec}: the model has no trainable parameters")
    if not hasattr(task.train_batches, "__next__"):
        raise ConfigError(f"{spec}: Task.train_batches must be an iterator of (x, y) batches")
    if not callable(task.loss_fn):
        raise ConfigError(f"{spec}: Task.loss_fn must be callable (model, x, y) -> loss")
    if task.optimizer is not None and not isinstance(task.optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{spec}: Task.optimizer must be a torch.optim.Optimizer or None")
    for batch in task.val_batches:
        _check_batch(batch, spec, "validation")
    return task


def _check_batch(batch: object, spec: str, what: str) -> None:
    if not (
        isinstance(batch, tuple)
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) for t in batch)
    ):
        raise ConfigError(f"{spec}: every {what} batch must be a tuple (x, y) of tensors")
