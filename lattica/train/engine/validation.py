"""Validation: the mean loss of a model on a task's validation batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lattica.train.engine.device import DeviceInfo, autocast
from lattica.train.engine.task import Task


def mean_validation_loss(
    model: torch.nn.Module, task: Task, device: DeviceInfo, *, weights: Sequence[torch.Tensor] | None = None,
) -> float:
    """Mean loss over ``task.val_batches`` (blocking), averaged in fp64; NaN without any. With
    ``weights`` (a strategy's evaluation weights, Streaming's θ̃) they stand in for the model's
    parameters meanwhile, which are put back after."""
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params] if weights is not None else None
    model.eval()
    try:
        with torch.no_grad():
            if weights is not None:
                for p, q in zip(params, weights, strict=True):
                    p.copy_(q)
            losses = []
            for x, y in task.val_batches:
                with autocast(device):
                    loss = task.loss_fn(model, x.to(device.device), y.to(device.device))
                losses.append(loss.detach().float())
    finally:
        if saved is not None:
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
    return float(torch.stack(losses).double().mean()) if losses else float("nan")
