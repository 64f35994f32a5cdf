"""The outer-step math the DiLoCo family shares, tensor math only (no I/O).

- ``outer_copy``: the outer weights φ, an fp32 copy of the model's parameters where the
  placement keeps the outer state (``engine.outer_placement``);
- ``pseudo_gradient``: Δ = φ − θ;
- ``nesterov_sgd``, ``nesterov_outer_step``: the outer optimizer, SGD with Nesterov momentum
  (as a ``torch.optim.SGD``, and the same arithmetic written out for the strategies that keep
  their own momentum buffers);
- ``eager_start``: the look-ahead an overlapping strategy starts its next inner phase from,
  the Nesterov step it would take on its own Δ, leaving φ and the momentum as they are;
- ``check_tensors``: an outer state's group of named tensors, from a checkpoint or a peer, held
  to the model's names and shapes before it is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lattica.train.engine.eager_optimizers import EagerSGD
from lattica.train.engine.outer_placement import OuterPlacement
from lattica.train.engine.outer_placement import pseudo_gradient as placed_pseudo_gradient


def pseudo_gradient(
    outer: Sequence[torch.Tensor], inner: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Δ = φ − θ per tensor, in the dtype and on the device of the outer weights (θ streamed
    to the host in chunks when φ is there and θ on CUDA: ``outer_placement``)."""
    return placed_pseudo_gradient(outer, inner)


def nesterov_outer_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    buffers: list[torch.Tensor | None],
    *,
    lr: float,
    momentum: float,
) -> None:
    """In place: b ← μ·b + Δ (b ← Δ on the first step); φ ← φ − η·(Δ + μ·b).

    The same arithmetic, in the same order, as ``torch.optim.SGD(nesterov=True, dampening=0)``.
    """
    with torch.no_grad():
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            buf = buffers[i]
            if buf is None:
                buf = buffers[i] = grad.clone()
            else:
                buf.mul_(momentum).add_(grad)
            param.add_(grad.add(buf, alpha=momentum), alpha=-lr)


def eager_start(
    outer: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor | None],
    fresh_own: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum_factor: float,
) -> list[torch.Tensor]:
    """s = φ − η·(Δ + μ·b'), b' = μ·b + Δ (b' = Δ before the first step): the Nesterov step
    ``torch.optim.SGD(nesterov=True)`` would take with gradient Δ, without changing φ or b."""
    starts = []
    for phi, buf, delta in zip(outer, momentum, fresh_own, strict=True):
        ahead = delta.clone() if buf is None else buf.mul(momentum_factor).add_(delta)
        starts.append(phi - lr * delta.add(ahead, alpha=momentum_factor))
    return starts


def outer_copy(
    model: torch.nn.Module, placement: OuterPlacement | None = None,
) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """Parameter names, the live (inner) parameters, and an fp32 copy where ``placement`` keeps
    the outer state (default: the CPU): the outer weights φ."""
    named = list(model.named_parameters())
    inner: list[torch.Tensor] = [p for _, p in named]
    return [n for n, _ in named], inner, (placement or OuterPlacement()).copy(inner)


def nesterov_sgd(outer: list[torch.Tensor], lr: float, momentum: float) -> torch.optim.SGD:
    """The DiLoCo outer optimizer: plain SGD with Nesterov momentum (plain SGD at momentum 0)."""
    return EagerSGD(  # torch.optim.SGD's arithmetic, without importing torch._dynamo
        outer, lr=lr, momentum=momentum,
        nesterov=momentum > 0,  # torch refuses Nesterov without momentum
        foreach=False,
    )


def check_tensors(
    what: str, given: object, names: list[str], reference: list[torch.Tensor], *, require_all: bool
) -> None:
    """``given`` (an outer state's ``what`` group, from a checkpoint or a peer) names only tensors
    of ``names`` (all of them when ``require_all``), each of its reference's shape; else ValueError."""
    if not isinstance(given, dict):
        raise ValueError(f"outer state {what} must be a dict of tensors")  # noqa: TRY004 - callers report a ValueError as a checkpoint mismatch
    known = dict(zip(names, reference, strict=True))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"outer state {what} has unknown tensors: {unknown[:5]}")
    if require_all and set(given) != set(known):
        raise ValueError(f"outer state {what} lacks tensors: {sorted(set(known) - set(given))[:5]}")
    for name, tensor in given.items():
        if not isinstance(tensor, torch.Tensor) or tensor.shape != known[name].shape:
            raise ValueError(f"outer state {what}[{name!r}] has the wrong type or shape")
