"""Pieces of one inner step that depend on the device: where its work is queued, and how a
batch's gradient is accumulated over micro-batches.

``WorkerStream``: on CUDA a trainer queues its inner steps on a CUDA stream of its own. The
worker thread first makes that stream wait (on the device) for what the calling thread queued
on its stream — an outer step's θ ← φ, DDP's averaged gradients — and at the end waits (on the
host) for its own stream, so the trio thread, which reads the weights next, sees finished
work. Several trainers in one process (the convergence harness) thus overlap on one GPU. On
the CPU it just calls the work.

``accumulate_gradients``: backward of a batch cut into ``parts`` micro-batches (unequal parts
allowed: ``tensor_split``), each part's mean loss weighted by its share of the rows, so the
accumulated gradient and the returned loss are those of the whole batch's mean loss (up to fp32
rounding) with one part's activations in memory. One part is the plain backward, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

_Result = TypeVar("_Result")
LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WorkerStream:
    """Runs a worker thread's work on the trainer's own CUDA stream (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]  # unannotated in torch

    def run(self, work: Callable[..., _Result], *args: Any) -> _Result:
        if self.stream is None:
            return work(*args)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                return work(*args)
        finally:
            self.stream.synchronize()


def accumulate_gradients(loss_of: LossOf, x: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
    """Backward of the batch's mean loss in ``parts`` micro-batches; the loss, detached."""
    if parts == 1:
        loss = loss_of(x, y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        return loss.detach()
    total: torch.Tensor | None = None
    for x_part, y_part in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
        if len(x_part) == 0:
            continue
        weighted = loss_of(x_part, y_part) * (len(x_part) / len(x))
        weighted.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        total = weighted.detach() if total is None else total + weighted.detach()
    if total is None:
        raise ValueError("a batch without rows")
    return total
