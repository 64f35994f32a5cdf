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

import torch
from torch import nn

from lattica.errors import ConfigError
from lattica.train.data import (
    BatchConfig,
    BatchSampler,
    DataConfig,
    load_corpus,
    validation_batches,
)
from lattica.train.model import GPTConfig, build_model, lm_loss, preset

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


def builtin_task(
    *,
    model: GPTConfig | str = "tiny",
    data: DataConfig | None = None,
    batch_size: int = 8,
    context: TaskContext | None = None,
    model_seed: int = 0,
    eval_batches: int = 8,
) -> Task:
    """The built-in byte-level GPT on a corpus (default: the Python standard library)."""
    gpt = preset(model) if isinstance(model, str) else model
    ctx = context or TaskContext()
    corpus = load_corpus(data or DataConfig())
    if corpus.vocab_size > gpt.vocab_size:
        gpt = GPTConfig(**{**gpt.__dict__, "vocab_size": corpus.vocab_size})
    sampler = BatchSampler(
        corpus.train,
        BatchConfig(
            batch_size=batch_size,
            context=gpt.context,
            seed=ctx.seed,
            shard_index=ctx.shard_index,
            num_shards=ctx.num_shards,
        ),
    )
    val = validation_batches(
        corpus.val, batch_size=batch_size, context=gpt.context, max_batches=eval_batches
    )
    return Task(
        model=build_model(gpt, seed=model_seed),
        train_batches=iter(sampler),
        val_batches=val,
        description=corpus.description,
        data_hash=corpus.content_hash,
        sampler=sampler,
    )


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
        raise ConfigError(f"{spec} must return lattica.train.task.Task, got {type(task).__name__}")
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
