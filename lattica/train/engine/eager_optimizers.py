"""The optimizers a trainer builds itself (inner AdamW, outer Nesterov SGD), without ``torch._dynamo``.

Theory of operation: ``torch.optim.Optimizer`` wraps ``add_param_group``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` in ``torch._disable_dynamo``, and every optimizer's
``step`` in ``_use_grad_for_differentiable``; both wrappers import ``torch._dynamo`` on their
first call, and with it sympy, the inductor's configuration and FSDP: about 1 s of CPU on an idle
2-core machine and 5 s of wall time on one loaded to 20, spent by every trainer before its first
inner step — by a restarted member while the swarm trains without it. Outside ``torch.compile``
the wrappers do nothing but keep dynamo from tracing the method (nothing traces it) and, for
``step``, turn autograd off (``differentiable`` is False). The classes here call the methods the
wrappers wrap (``inspect.unwrap``: ``__wrapped__`` down to the plain function) and turn autograd
off around ``step`` themselves: the same arithmetic on the same tensors, the same state dicts (a
checkpoint written by ``torch.optim.AdamW`` loads, and the other way round). ``compile = true``
compiles the model, not the optimizer: dynamo is then imported by the compile, and the optimizer
steps stay eager either way. A task's own optimizer is used as given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

_Optimizer = torch.optim.Optimizer


def _plain_step(cls: type[_Optimizer]) -> Callable[..., Any]:
    """``cls.step`` without its wrappers, called with autograd off (what the wrapper did)."""
    plain = inspect.unwrap(cls.step)

    def step(self: _Optimizer, closure: Callable[[], float] | None = None) -> Any:
        with torch.no_grad():
            return plain(self, closure)

    return step


class _PlainMethods(_Optimizer):
    """``torch.optim.Optimizer``'s methods without the wrappers that import dynamo."""

    add_param_group = inspect.unwrap(_Optimizer.add_param_group)
    zero_grad = inspect.unwrap(_Optimizer.zero_grad)
    state_dict = inspect.unwrap(_Optimizer.state_dict)
    load_state_dict = inspect.unwrap(_Optimizer.load_state_dict)


class EagerAdamW(_PlainMethods, torch.optim.AdamW):
    """``torch.optim.AdamW`` that never imports ``torch._dynamo`` (module docstring)."""

    step = _plain_step(torch.optim.AdamW)


class EagerSGD(_PlainMethods, torch.optim.SGD):
    """``torch.optim.SGD`` that never imports ``torch._dynamo`` (module docstring)."""

    step = _plain_step(torch.optim.SGD)
