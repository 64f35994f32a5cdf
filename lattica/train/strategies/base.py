"""What every outer strategy looks like to the trainer.

The trainer owns the model and the inner optimizer and runs inner steps in a worker thread.
Between two inner steps, on the trio thread, it calls ``strategy.after_inner_step(step)``.
A strategy decides from the step number whether it syncs now:

- blocking DiLoCo: every H steps it awaits an all-reduce and applies the outer step;
- eager / streaming: it starts communication in ``self.nursery`` and applies the result some
  steps later, so inner steps keep running while tensors are on the wire.

A strategy whose per-sync work between two steps is tensor math only (Streaming: snapshot a
fragment to send, apply a mean that has arrived) may also do it in the worker thread, through
``sync_in_thread``: the inner steps then go on without handing off to the event loop.

Strategies see the network only through a ``Collective`` and learn who takes part in a sync from
a ``GroupProvider`` (the daemon answers from the replicated state; tests answer with a fixed
list). All tensor math lives in pure functions next to each strategy, tested without any I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import trio

from lattica.train.collective import Collective


class GroupProvider(Protocol):
    async def group_for(self, key: str) -> Sequence[str]:
        """The agreed, identically ordered member list (including this node) for sync ``key``.

        ``key`` names one sync uniquely in the run, e.g. ``"round/12"`` or
        ``"round/12/fragment/1"``. Peers that miss the deadline are left out.
        """
        ...


@dataclass(frozen=True, kw_only=True)
class OuterStepReport:
    """What happened at one sync, for logs, metrics and the replicated progress record."""

    round: int
    key: str
    group: tuple[str, ...]
    bytes_sent: int
    seconds: float
    skipped: bool = False
    detail: str = ""


class OuterStrategy(ABC):
    """Base of DiLoCo, eager/streaming DiLoCo, NoLoCo and SPES."""

    name: str = "base"
    replicas_agree: bool = False
    """True when every member of a completed sync holds bit-identical outer state (DiLoCo,
    Streaming DiLoCo, SPES); False where replicas differ by design (NoLoCo, eager DiLoCo).
    Only agreeing strategies let a late or new peer adopt the others' state by its hash."""

    consensus_distance: float | None = None
    """Where replicas differ (gossip averaging): this replica's last measured distance to its
    group's mean outer weights, relative to their norm (``gossip.consensus_distance``); None
    where replicas agree or before the first group exchange."""

    #: Set by strategies that must see the gradients of every inner step before the inner
    #: optimizer uses them (data-parallel baselines); the trainer then calls
    #: ``before_optimizer_step`` between backward and ``optimizer.step()``.
    syncs_gradients: bool = False

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
    ) -> None:
        self.model = model
        self.collective = collective
        self.groups = groups
        self.nursery: trio.Nursery | None = None

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        """Give the strategy a nursery for communication that overlaps inner steps."""
        self.nursery = nursery

    async def before_optimizer_step(self, step: int) -> None:
        """Called on the trio thread after backward of step ``step`` when ``syncs_gradients``."""
        return None

    @abstractmethod
    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        """Called after inner step ``step`` (1-based); returns the syncs completed now."""

    def next_sync_step(self, step: int) -> int | None:
        """The first step after ``step`` at which ``after_inner_step`` may do anything.

        The trainer runs the inner steps up to that one in a single worker-thread call and calls
        ``after_inner_step`` only there (and at reports and validations): a strategy must do
        nothing at the steps it skips. ``None``: never (no communication). The default, the
        next step, is always correct.
        """
        return step + 1

    def sync_in_thread(self, step: int) -> list[OuterStepReport] | None:
        """Worker thread, after inner step ``step`` (a step ``next_sync_step`` named): do this
        step's sync work here instead of in ``after_inner_step``.

        Returns the syncs completed now, or ``None`` when the trio thread must take this step:
        then nothing was done and the trainer calls ``after_inner_step(step)`` as usual. Only
        tensors may be touched here: communication is started on the trio thread with
        ``trio.lowlevel.TrioToken.run_sync_soon`` (which does not wait), and a result may be
        waited for only on a thread event that its trio task sets however it ends, so that
        cancelling the trainer's nursery releases the worker. The default: never.
        """
        return None

    async def finish(self) -> list[OuterStepReport]:
        """Complete in-flight syncs at the end of training (default: nothing in flight)."""
        return []

    @property
    @abstractmethod
    def completed_rounds(self) -> int:
        """Number of outer rounds fully applied on this node."""

    @abstractmethod
    def outer_state_dict(self) -> dict[str, Any]:
        """Outer weights and outer optimizer state, for checkpoints and joiners."""

    @abstractmethod
    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``outer_state_dict`` returned (a joiner or a restarted peer)."""

    def evaluation_parameters(self) -> Sequence[torch.Tensor] | None:
        """Parameters to evaluate on, when they differ from the model's (Streaming: θ̃)."""
        return None
