"""Activation checkpointing: each layer recomputes its activations during backward.

A large preset at a long context keeps every layer's activations until backward; with
checkpointing a layer keeps only its input and runs its forward again when backward reaches
it, so activation memory grows with one layer instead of all of them, for about a third more
compute. The layers are the children of the model's outermost ``nn.ModuleList``s (the built-in
GPT's blocks; a user model built the usual way has its layers there too). Only the layer's
``forward`` is wrapped, on the instance: parameter names, the state dict and the outer
weights' hashes stay as they are. In evaluation (no gradients) a layer runs plainly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_layers(model: nn.Module) -> int:
    """Wrap the layers of ``model``'s outermost ``ModuleList``s; how many were wrapped."""
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(w + ".") for w in wrapped):
            continue
        for index, layer in enumerate(module):
            if not _is_checkpointed(layer):
                layer.forward = functools.partial(_checkpointed, layer, layer.forward)
            wrapped.append(f"{name}.{index}" if name else str(index))
    return len(wrapped)


def _is_checkpointed(layer: nn.Module) -> bool:
    forward = layer.forward
    return isinstance(forward, functools.partial) and forward.func is _checkpointed


def _checkpointed(layer: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if layer.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)
