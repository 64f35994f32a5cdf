"""The module the inner steps call: the model under ``torch.compile``, or the model itself.

Theory of operation
-------------------
``compile_enabled`` turns the run setting into a decision: ``true``/``false`` as given, and
``"auto"`` on for CUDA and off for the CPU (compiling a model takes tens of seconds; on the
CPU the small models that train there gain less than that).

``ForwardModule`` holds the model and, when compiling, ``torch.compile(model)``: a wrapper
that shares the model's parameters, so the optimizer, the strategy, checkpoints and hashes
all keep using the model itself — only the forward of an inner step goes through the
wrapper. Evaluation and everything else use the eager model.

Compilation happens at the first call, so that is where it fails (a missing compiler, an
unsupported operation, a backend error). ``run(step)`` runs the first training step through
the compiled module under a guard: when it raises, ``on_retry`` discards what the step left
(its gradients) and the step runs again on the eager model. If that works, the failure was
the compiler's: one warning line, and training stays eager from then on. If the eager step
fails too, the error is the task's own and propagates. After a first step that succeeded,
calls are not guarded. First calls take a lock shared by the process: torch.compile's tracing
is not made to run in several threads at once, and several trainers in one process (the
convergence harness, training scripts) would otherwise compile side by side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal, TypeVar

import torch
from torch import nn

log = logging.getLogger(__name__)

_Result = TypeVar("_Result")
COMPILE_BACKEND: str | Callable[..., object] = "inductor"  # torch.compile's code generator
_FIRST_CALLS = threading.Lock()  # one compilation at a time in a process


def compile_enabled(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """Whether to compile on ``device`` (``"auto"``: on CUDA only)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


class ForwardModule:
    """The module an inner step's forward runs through (module docstring)."""

    def __init__(self, model: nn.Module, *, compile: bool, backend: str | Callable[..., object] | None = None) -> None:
        self.eager = model
        self.module: nn.Module = model
        self.compiled = False
        self._proven = True
        if compile:
            try:
                self.module = torch.compile(model, backend=backend or COMPILE_BACKEND)  # type: ignore[assignment]  # an OptimizedModule is an nn.Module
            except Exception as exc:  # noqa: BLE001 - torch.compile may refuse a model or platform in many ways
                log.warning("torch.compile is not available (%s: %s); training eagerly", type(exc).__name__, exc)
            else:
                self.compiled, self._proven = True, False

    def run(self, step: Callable[[nn.Module], _Result], *, on_retry: Callable[[], None]) -> _Result:
        """``step(module)``; the first compiled call falls back to eager (module docstring)."""
        if self._proven:
            return step(self.module)
        with _FIRST_CALLS:
            return self._first_call(step, on_retry)

    def _first_call(self, step: Callable[[nn.Module], _Result], on_retry: Callable[[], None]) -> _Result:
        try:
            result = step(self.module)
        except Exception as compiled_error:  # noqa: BLE001 - compiler failures come in many types
            on_retry()
            result = step(self.eager)  # the task's own error, if it fails here too
            log.warning(
                "torch.compile failed (%s: %s); training eagerly",
                type(compiled_error).__name__, _first_line(compiled_error),
            )
            self.module, self.compiled = self.eager, False
        self._proven = True
        return result


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no message"
