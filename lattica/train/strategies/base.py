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
a ``GroupProvider`` (``lattica.coordination``: the daemon answers from the replicated state;
tests answer with a fixed list). All tensor math lives in pure functions next to each strategy,
tested without any I/O. Blocking strategies that sync every H steps share ``EveryHSteps``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, Self, TypeVar, cast

import torch
import trio

from lattica.coordination.provider import GroupProvider as GroupProvider
from lattica.numerics.partner_screen import PartnerScreen
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.strategies.experts import ExpertOwnership

ConfigT = TypeVar("ConfigT", covariant=True)  # a strategy's frozen config dataclass (None: it has none)


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
    # gossip averaging: this replica's distance to its group's mean outer weights, relative to
    # their norm (``gossip.consensus_distance``); None where replicas agree or no partner answered
    consensus_distance: float | None = None


@dataclass(frozen=True, kw_only=True)
class StrategyHandles:
    """What the node can hand a strategy besides its model, collective, groups and config; a
    strategy takes what it declares it needs in ``OuterStrategy.build``."""

    ownership: ExpertOwnership | None = None  # ``trains_experts``: the replicated expert ownership
    # how partners' contributions are judged (the run's ``max_norm_ratio``) and where a refusal
    # is reported (the daemon scores the peer down); None: the default screen, refusals logged
    partner_screen: PartnerScreen | None = None


class OuterStrategy(ABC, Generic[ConfigT]):
    """Base of DiLoCo, eager/streaming DiLoCo, NoLoCo and SPES, generic over its config.

    Everything the trainer and the training service call is declared here, with a default where
    a strategy may leave it out: hooks (``before_optimizer_step``, ``next_sync_step``,
    ``sync_in_thread``, ``finish``, ``attach_inner_optimizer``, ``accounting``) and capabilities
    (``replicas_agree``, ``syncs_gradients``, ``averages_in_groups``, ``trains_experts``). Nothing
    is looked up by name: a wrapper (the daemon's outer-state sync) implements the same interface
    around a strategy and forwards what it does not change.
    """

    name: str = "base"
    config_class: ClassVar[type | None] = None
    """The frozen config dataclass the constructor's ``config`` takes (None: no config); its
    defaults are the strategy's when no config is given."""

    replicas_agree: bool = False
    """True when every member of a completed sync holds bit-identical outer state (DiLoCo,
    Streaming DiLoCo, SPES); False where replicas differ by design (NoLoCo, eager DiLoCo).
    Only agreeing strategies let a late or new peer adopt the others' state by its hash."""

    #: Set by strategies that must see the gradients of every inner step before the inner
    #: optimizer uses them (data-parallel baselines); the trainer then calls
    #: ``before_optimizer_step`` between backward and ``optimizer.step()``.
    syncs_gradients: bool = False

    #: Set by strategies whose members each train a part of a mixture-of-experts model (SPES):
    #: the built-in task then trains an MoE model, and the daemon keeps expert ownership in the
    #: replicated state and hands it to ``build`` (``StrategyHandles.ownership``).
    trains_experts: ClassVar[bool] = False

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        """Whether this strategy, with ``config``, syncs inside small groups drawn without a
        coordinator (``lattica.coordination.gossip``) instead of one group per round; its
        replicas then differ, and a replica that falls behind adopts the newest published one."""
        return False

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: object | None,
        handles: StrategyHandles,
    ) -> OuterStrategy[object]:
        """The strategy with ``config`` (an instance of ``config_class``, None: its default),
        given the node's ``handles``. Default: the constructor, which needs none of them; a
        strategy that needs one overrides this and takes it from ``handles``."""
        # the constructor refuses a config that is not a ``config_class``
        typed = cast("ConfigT | None", config)
        return cls(model, collective=collective, groups=groups, config=typed).take_handles(handles)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: ConfigT | None = None,
    ) -> None:
        """``config``: an instance of ``config_class`` (None: its defaults), kept as ``self.config``."""
        if config is not None and (self.config_class is None or not isinstance(config, self.config_class)):
            expected = self.config_class.__name__ if self.config_class is not None else "no config"
            raise TypeError(f"strategy {self.name!r} takes {expected}, got {type(config).__name__}")
        self.config: ConfigT = config if config is not None else self.default_config()
        self.model = model
        self.collective = collective
        self.groups = groups
        self.nursery: trio.Nursery | None = None
        # judges what partners send before it is averaged (``numerics.partner_screen``)
        self.partner_screen = PartnerScreen()

    @classmethod
    def default_config(cls) -> ConfigT:
        """``config_class`` with its defaults (None for a strategy without a config)."""
        return cast(ConfigT, cls.config_class() if cls.config_class is not None else None)

    def take_handles(self, handles: StrategyHandles) -> Self:
        """Use the node's partner screen when it gives one (``build`` calls this)."""
        if handles.partner_screen is not None:
            self.partner_screen = handles.partner_screen
        return self

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        """Give the strategy a nursery for communication that overlaps inner steps."""
        self.nursery = nursery

    def attach_inner_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The trainer's inner optimizer, once built (accounting; SPES drops the state of the
        experts it stops owning). Default: not needed."""
        return None

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

    def rounds_landed_late(self) -> int:
        """How many syncs late a round's mean is applied here (CO2: 1; default 0). A member that
        many completed rounds behind us is at our round of the all-reduce: it has not landed
        the means we landed at our last sync yet (``outer_sync.OuterStateSync.not_behind``)."""
        return 0

    def lands_next_round(self) -> bool:
        """Whether this replica's next sync completes the next round of the line it is on with a
        mean it already holds: strategies that apply each round's mean one sync late (CO2) and
        hold it in flight. A member one round ahead of it then is only faster, not on another
        line (``outer_sync.OuterStateSync.repair_if_diverged``). Default: False."""
        return False

    @abstractmethod
    def outer_state_dict(self) -> StateDict:
        """Outer weights and outer optimizer state, for checkpoints and joiners."""

    @abstractmethod
    def load_outer_state_dict(self, state: StateDict) -> None:
        """Restore what ``outer_state_dict`` returned (a joiner or a restarted peer)."""

    def evaluation_parameters(self) -> Sequence[torch.Tensor] | None:
        """Parameters to evaluate on, when they differ from the model's (Streaming: θ̃)."""
        return None

    def accounting(self) -> dict[str, int]:
        """Traffic and memory figures for the metrics (``accounting.AccountedStrategy``);
        empty by default."""
        return {}


def next_multiple(step: int, every: int) -> int:
    """The first multiple of ``every`` after ``step``."""
    return (step // every + 1) * every


class EveryHSteps(OuterStrategy[ConfigT]):
    """The blocking every-H schedule: one sync after inner steps H, 2H, 3H, … and nothing at
    the steps between (``next_sync_step`` lets the trainer run those in one go).

    A strategy names H in ``sync_interval`` and does one sync in ``sync_at(step)``; mix it in
    before the strategy's other base (``class DiLoCo(EveryHSteps, AccountedStrategy)``).
    """

    @property
    @abstractmethod
    def sync_interval(self) -> int:
        """H: inner steps between two syncs."""

    @abstractmethod
    async def sync_at(self, step: int) -> OuterStepReport:
        """The sync after inner step ``step``, a multiple of H."""

    def next_sync_step(self, step: int) -> int:
        return next_multiple(step, self.sync_interval)

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if step % self.sync_interval:
            return []
        return [await self.sync_at(step)]


class WrappedStrategy(OuterStrategy[None]):
    """A strategy around another one: forwards every call and capability to ``inner``; a
    subclass overrides only the hooks whose behaviour it adds to (the daemon's outer-state sync
    in ``train/swarm/outer_sync.py``), so the inner strategy is never patched."""

    def __init__(self, inner: OuterStrategy[object]) -> None:
        super().__init__(inner.model, collective=inner.collective, groups=inner.groups)
        self.inner = inner

    # the capabilities are the inner strategy's: read and written through
    @property
    def name(self) -> str:
        return self.inner.name

    @name.setter
    def name(self, value: str) -> None:
        self.inner.name = value

    @property
    def replicas_agree(self) -> bool:
        return self.inner.replicas_agree

    @replicas_agree.setter
    def replicas_agree(self, value: bool) -> None:
        self.inner.replicas_agree = value

    @property
    def syncs_gradients(self) -> bool:
        return self.inner.syncs_gradients

    @syncs_gradients.setter
    def syncs_gradients(self, value: bool) -> None:
        self.inner.syncs_gradients = value

    def take_handles(self, handles: StrategyHandles) -> Self:
        self.inner.take_handles(handles)
        return self

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        super().bind_nursery(nursery)
        self.inner.bind_nursery(nursery)

    def attach_inner_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.attach_inner_optimizer(optimizer)

    async def before_optimizer_step(self, step: int) -> None:
        await self.inner.before_optimizer_step(step)

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        return await self.inner.after_inner_step(step)

    def next_sync_step(self, step: int) -> int | None:
        return self.inner.next_sync_step(step)

    def sync_in_thread(self, step: int) -> list[OuterStepReport] | None:
        return self.inner.sync_in_thread(step)

    async def finish(self) -> list[OuterStepReport]:
        return await self.inner.finish()

    @property
    def completed_rounds(self) -> int:
        return self.inner.completed_rounds

    def lands_next_round(self) -> bool:
        return self.inner.lands_next_round()

    def rounds_landed_late(self) -> int:
        return self.inner.rounds_landed_late()

    def outer_state_dict(self) -> StateDict:
        return self.inner.outer_state_dict()

    def load_outer_state_dict(self, state: StateDict) -> None:
        self.inner.load_outer_state_dict(state)

    def evaluation_parameters(self) -> Sequence[torch.Tensor] | None:
        return self.inner.evaluation_parameters()

    def accounting(self) -> dict[str, int]:
        return self.inner.accounting()
