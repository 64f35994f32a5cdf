"""Re-tuning a running swarm (``tune = true``): the admin measures, tunes and publishes; every
member follows the tuned sync schedule the run config holds.

Theory of operation
-------------------
**Where it is decided.** Only an admin tunes, after a round it took part in: it measures the
inner step (``PhaseTimer``: the wall time of the inner phase before the round over its steps),
the fp32 payload, the bandwidth to the round's other members (the lower of the slowest peer's
last timed message and the round's own bytes over its wall time: ``tuner.measure``) and the
RTT (a clock ping, the farthest peer's) and the communication CPU per byte (below), and hands
them to ``decide``. The second round it took part in tunes (the first's wall time holds the
members' start skew, so its rate is not the link's); a later one re-tunes only when the
bandwidth or the CPU per byte moved by more than ``factor`` (2×) either way since the last
tuning (``retune_reason``). Every decision is logged with its numbers.

**What a member may change between rounds.** H, and the codec for the strategies whose config
has one (``CODEC_STRATEGIES``: a codec changes what a round sends, not the outer state). The
search runs with the other knobs fixed at the run's values (``fixed_knobs``), so its H and codec
are right for the run as it is. The free search's choice is computed too, and every knob it
would set differently is *reported* in the decision, the log and ``lattica status``
(``not_applied``), never applied: the data plane's chunk size is no run setting; overlap means
strategy ``co2`` and a smaller group means gossip averaging, whose outer state differs from the
running strategy's — they take a restart with those settings (``lattica tune`` prints them).

**What it measures of the CPU.** Communication costs CPU (encoding, encryption, framing,
copies, the reduction), which on a CPU-trained node the inner steps pay (``autotune``'s cost
model). ``PhaseTimer`` measures it: in a blocking run, the process CPU of the sync over the
bytes sent; in an overlapped one (``co2``, ``gossip_overlap``), how much slower the last phase's
steps were than the first phase's — timed before the first sync, with no exchange in flight,
from a stop ``WARMUP_STEPS`` after the node's first step — over the bytes the overlapped
exchange sent. A re-tuning is due when the bandwidth *or* this CPU per byte moved by more than
``factor``.

**How members agree.** The admin appends a period ``(from_step, H, codec)`` to the ``tuned``
entry of the run config — signed, admin-only, replicated like every run setting — and ``from_step`` is
the *next* sync step of the schedule in force, a whole inner phase ahead, so every member holds
the entry before it matters. The schedule is a pure function of the run config
(``next_sync_step``): syncs at the multiples of the run's H, then from each period's
``from_step`` on every H of that period, and at the last step of the run; each sync after a
period's ``from_step`` sends with the period's codec (``codec_at``). A member never
derives a period itself, so no member applies a schedule the others do not hold; a member that
gets the entry late finds its next sync where the others' is (the function is the same). A
malformed entry (only an admin can write one, but a buggy or hostile admin can) is
refused with one warning and the schedule in force stays.

Which strategies: those that sync every H steps and key their rounds by a round counter
(``TUNABLE_STRATEGIES``); for any other ``tune = true`` is refused at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lattica.train.settings.autotune import (
    CODEC_BITS,
    DEFAULT_MIN_ROUNDS,
    Measurements,
    Tuned,
    comm_cpu_per_byte,
    needs_retune,
    slowdown_cpu_per_byte,
    tune,
)
from lattica.train.strategies.base import (
    EveryHSteps,
    OuterStepReport,
    OuterStrategy,
    WrappedStrategy,
)

log = logging.getLogger(__name__)

TUNED_KEY = "tuned"  # the run config's entry
TUNABLE_STRATEGIES = ("diloco", "co2", "desloc", "local_adam", "sparseloco")
CODEC_STRATEGIES = ("diloco", "co2", "desloc", "local_adam")  # a ``codec`` the tuned periods may set
MAX_PERIODS = 64  # periods in the tuned entry; a run that re-tuned this often stops re-tuning
MAX_INNER_STEPS = 1_000_000
RETUNE_FACTOR = 2.0
WARMUP_STEPS = 2  # a node's first steps (allocation, the first batches) are not timed


@dataclass(frozen=True, kw_only=True)
class Period:
    """From ``from_step`` (a sync step) on, a sync every ``inner_steps`` steps, each sending
    with ``codec`` (None: the run's own)."""

    from_step: int
    inner_steps: int
    codec: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.from_step) or self.from_step < 0:
            raise ValueError(f"from_step must be an integer >= 0, got {self.from_step!r}")
        if not _is_int(self.inner_steps) or not 1 <= self.inner_steps <= MAX_INNER_STEPS:
            raise ValueError(f"inner_steps must be an integer in [1, {MAX_INNER_STEPS}], got {self.inner_steps!r}")
        if self.codec is not None and self.codec not in CODEC_BITS:
            raise ValueError(f"codec must be one of {', '.join(CODEC_BITS)}, got {self.codec!r}")

    def to_json(self) -> list[object]:
        return [self.from_step, self.inner_steps] + ([self.codec] if self.codec is not None else [])


@dataclass(frozen=True, kw_only=True)
class TunedEntry:
    """The run config's ``tuned`` entry: the periods, what the last tuning measured, and what
    it would change but cannot."""

    periods: tuple[Period, ...]
    bandwidth_bps: float
    not_applied: tuple[str, ...] = ()
    comm_cpu_s_per_byte: float = 0.0  # what the last tuning measured (``Measurements``)

    def __post_init__(self) -> None:
        if len(self.periods) > MAX_PERIODS:
            raise ValueError(f"at most {MAX_PERIODS} periods, got {len(self.periods)}")
        steps = [p.from_step for p in self.periods]
        if steps != sorted(set(steps)):
            raise ValueError("periods must have increasing from_step")
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth_bps must be a finite positive number, got {self.bandwidth_bps!r}")
        if not (math.isfinite(self.comm_cpu_s_per_byte) and 0 <= self.comm_cpu_s_per_byte < 1):
            raise ValueError(f"comm_cpu_s_per_byte must be a finite number in [0, 1), got {self.comm_cpu_s_per_byte!r}")
        if len(self.not_applied) > 16 or any(not isinstance(n, str) or len(n) > 300 for n in self.not_applied):
            raise ValueError("not_applied must be at most 16 lines of at most 300 characters")

    def to_json(self) -> dict[str, object]:
        return {
            "periods": [p.to_json() for p in self.periods],
            "bandwidth_bps": self.bandwidth_bps, "not_applied": list(self.not_applied),
            "comm_cpu_s_per_byte": self.comm_cpu_s_per_byte,
        }


def parse_entry(value: object) -> TunedEntry:
    """The ``tuned`` entry from the run config's JSON; ``ValueError`` naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("the tuned entry must be an object")  # noqa: TRY004 - bad input, one kind
    periods = value.get("periods")
    if not isinstance(periods, list) or len(periods) > MAX_PERIODS:
        raise ValueError(f"tuned.periods must be a list of at most {MAX_PERIODS} [from_step, H] pairs")
    parsed = []
    for pair in periods:
        if not isinstance(pair, list) or len(pair) not in (2, 3):
            raise ValueError("tuned.periods must hold [from_step, H] pairs or [from_step, H, codec] triples")
        parsed.append(Period(from_step=pair[0], inner_steps=pair[1], codec=pair[2] if len(pair) == 3 else None))
    bandwidth = value.get("bandwidth_bps")
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float):
        raise ValueError("tuned.bandwidth_bps must be a number")  # noqa: TRY004 - bad input, one kind
    not_applied = value.get("not_applied", [])
    if not isinstance(not_applied, list):
        raise ValueError("tuned.not_applied must be a list of lines")  # noqa: TRY004 - bad input, one kind
    cpu = value.get("comm_cpu_s_per_byte", 0.0)
    if isinstance(cpu, bool) or not isinstance(cpu, int | float):
        raise ValueError("tuned.comm_cpu_s_per_byte must be a number")  # noqa: TRY004 - bad input, one kind
    return TunedEntry(periods=tuple(parsed), bandwidth_bps=float(bandwidth), not_applied=tuple(not_applied),
                      comm_cpu_s_per_byte=float(cpu))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the schedule: a pure function of the run's H, the periods and the run's end -------------


def next_sync_step(step: int, *, base: int, periods: Sequence[Period], end: int) -> int:
    """The first sync step after ``step`` (module docstring)."""
    current = Period(from_step=0, inner_steps=base)
    upcoming = None
    for period in periods:
        if period.from_step <= step:
            current = period
        else:
            upcoming = period.from_step
            break
    since = step - current.from_step
    following = current.from_step + (since // current.inner_steps + 1) * current.inner_steps
    candidates = [following, end if end > step else following]
    if upcoming is not None:
        candidates.append(upcoming)
    return min(candidates)


def period_at(step: int, *, base: int, periods: Sequence[Period]) -> int:
    """H in force after ``step``."""
    return next((p.inner_steps for p in reversed(periods) if p.from_step <= step), base)


def codec_at(step: int, *, base: str, periods: Sequence[Period]) -> str:
    """The codec in force after ``step``: the sync at a period's ``from_step`` is the last of
    the period before, as for H."""
    return next((p.codec for p in reversed(periods) if p.from_step <= step and p.codec is not None), base)


class TunedPeriods(WrappedStrategy):
    """A strategy that syncs every H steps, synced on the tuned schedule instead (module
    docstring): ``periods`` reads the run config's periods; ``end`` is the run's last step.
    Times each inner phase for the tuner — the first from ``WARMUP_STEPS`` after this node's
    first step, where the trainer stops once to start the clock — and the CPU of each sync."""

    def __init__(self, inner: OuterStrategy[object], *, periods: Callable[[], tuple[Period, ...]], end: int) -> None:
        if not isinstance(inner, EveryHSteps):
            raise TypeError(f"{type(inner).__name__} does not sync every H steps: H cannot be tuned")
        super().__init__(inner)
        self._every = inner
        self._periods = periods
        self.end = end
        self.timer = PhaseTimer()
        self._clock_start: int | None = None  # the step where the first phase's clock starts
        self.base_codec: str | None = getattr(inner.config, "codec", None)  # None: a codec of its own

    @property
    def base(self) -> int:
        return self._every.sync_interval

    def sync_step_after(self, step: int) -> int:
        """The first sync step of the tuned schedule after ``step``."""
        return next_sync_step(step, base=self.base, periods=self._periods(), end=self.end)

    def next_sync_step(self, step: int) -> int:
        if self._clock_start is None:
            self._clock_start = step + WARMUP_STEPS
        sync = self.sync_step_after(step)
        return self._clock_start if step < self._clock_start < sync else sync

    def sync_in_thread(self, step: int) -> list[OuterStepReport] | None:
        return None  # every sync on the trio thread, where the schedule is read

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if step == self._clock_start:
            self.timer.start(step)
        if step == 0 or self.sync_step_after(step - 1) != step:
            return []
        self.timer.phase_ended(step)
        self._use_codec(step - 1)
        self.timer.sync_started()
        try:
            return [await self._every.sync_at(step)]
        finally:
            self.timer.sync_ended(step)

    def inner_steps_now(self, step: int) -> int:
        return period_at(step, base=self.base, periods=self._periods())

    def codec_now(self, step: int) -> str | None:
        if self.base_codec is None:
            return None
        return codec_at(step, base=self.base_codec, periods=self._periods())

    def _use_codec(self, step: int) -> None:
        """The sync after ``step`` sends with the codec in force there: the wrapped strategy's
        config gets it (every member reads the same periods, so all send alike)."""
        codec = self.codec_now(step)
        config: Any = self._every.config
        if codec is not None and config.codec != codec:
            self._every.config = dataclasses.replace(config, codec=codec)


class PhaseTimer:
    """The wall time of inner phases: from the end of one sync to the start of the next, over
    the steps between (reports and validations included: they delay a round as steps do).

    ``step_s`` is the last phase's step, ``clean_step_s`` the first timed phase's — before the
    first sync, so with no exchange in flight: the step an overlapped exchange slows down
    (``autotune.slowdown_cpu_per_byte``) — and ``phase_steps`` the last phase's length.
    ``sync_cpu_s`` is the process CPU of the last sync: in a blocking sync the inner steps
    wait, so it is the exchange's (``autotune.comm_cpu_per_byte``)."""

    def __init__(self) -> None:
        self._since: tuple[int, float] | None = None
        self._cpu_since = 0.0
        self.step_s: float | None = None
        self.clean_step_s: float | None = None
        self.phase_steps = 0
        self.sync_cpu_s: float | None = None

    def start(self, step: int) -> None:
        if self._since is None:
            self._since = (step, time.monotonic())

    def phase_ended(self, step: int) -> None:
        if self._since is not None and step > self._since[0]:
            self.phase_steps = step - self._since[0]
            self.step_s = (time.monotonic() - self._since[1]) / self.phase_steps
            if self.clean_step_s is None:
                self.clean_step_s = self.step_s

    def sync_started(self) -> None:
        self._cpu_since = time.process_time()

    def sync_ended(self, step: int) -> None:
        self.sync_cpu_s = time.process_time() - self._cpu_since
        self._since = (step, time.monotonic())


def step_and_comm_cpu(timer: PhaseTimer, *, overlapped: bool, bytes_sent: int) -> tuple[float | None, float]:
    """The inner step with no exchange in flight and the communication CPU per byte sent, as
    ``timer`` measured them around a round that sent ``bytes_sent``: overlapped, the first
    phase's step and the last phase's slow-down against it; blocking, the last phase's step and
    the last sync's process CPU."""
    if overlapped:
        if timer.step_s is None or timer.clean_step_s is None:
            return timer.clean_step_s, 0.0
        return timer.clean_step_s, slowdown_cpu_per_byte(
            step_s=timer.step_s, clean_step_s=timer.clean_step_s, steps=timer.phase_steps, bytes_sent=bytes_sent,
        )
    return timer.step_s, comm_cpu_per_byte(cpu_s=timer.sync_cpu_s or 0.0, bytes_sent=bytes_sent)


# -- the admin's decision (sans-IO) ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Decision:
    entry: TunedEntry
    applied: Tuned  # the search with the run's other knobs fixed: its H is applied
    free: Tuned  # the unconstrained search: what it changes besides H is reported
    reason: str


def fixed_knobs(strategy: str, averaging: str, group_size: int, gossip_overlap: bool) -> dict[str, object]:
    """The knobs a running swarm cannot change, at the run's values (module docstring)."""
    overlap: object = strategy if strategy in ("co2", "eager") else "eager" if gossip_overlap else False
    group = 0 if averaging == "allreduce" else group_size
    fixed: dict[str, object] = {"overlap": overlap, "group_size": group if group in (0, 2, 4) else 2}
    if strategy not in CODEC_STRATEGIES:
        fixed["codec"] = "fp32"
    return fixed


def not_applied(free: Tuned, applied: Tuned, fixed: Mapping[str, object]) -> tuple[str, ...]:
    """One line per knob the run holds (``fixed``) that the free search sets differently."""
    why = {
        "codec": "the strategy sends a compression of its own, not a codec",
        "overlap": "overlap is strategy eager or co2 (or gossip_overlap): its outer state differs; restart with it",
        "group_size": "a group size is gossip averaging: its outer state differs; restart with it",
    }
    lines = [f"{knob} = {getattr(free.config, knob)}: {reason}" for knob, reason in why.items()
             if knob in fixed and getattr(free.config, knob) != getattr(applied.config, knob)]
    lines.append(f"chunk_bytes = {applied.config.chunk_bytes}: the data plane's chunk size is no run setting")
    return tuple(lines)


def decide(
    measured: Measurements, *, current: TunedEntry | None, fixed: Mapping[str, object], next_sync: int,
    base: int, target: float, factor: float = RETUNE_FACTOR, base_codec: str | None = None,
    min_rounds: int = DEFAULT_MIN_ROUNDS,
) -> Decision | None:
    """Whether to (re-)tune now, and the new entry: ``None`` when the bandwidth and the
    communication CPU are within ``factor`` of the last tuning's, or the periods are full.
    ``next_sync``: the next sync step of the schedule in force, where a new period starts;
    ``base``, ``base_codec``: the run's H and codec (None: the strategy has no codec); ``min_rounds``:
    the applied rounds an H must leave in ``measured.steps_left``; none left (the next sync is the
    run's last): ``None``, no period would come into force."""
    if measured.steps_left == 0:
        return None
    if current is not None:
        reason = retune_reason(current, measured, factor=factor)
        if reason is None:
            return None
        if len(current.periods) >= MAX_PERIODS:
            log.warning("tune: %d periods published already; the schedule stays", MAX_PERIODS)
            return None
    else:
        reason = (f"first tuning: bandwidth {measured.bandwidth_bps / 1e6:.1f} Mbit/s, communication CPU "
                  f"{measured.comm_cpu_s_per_byte * 1e9:.0f} ns/byte")
    applied = tune(measured, target=target, fixed=fixed, min_rounds=min_rounds)
    free = tune(measured, target=target, min_rounds=min_rounds)
    periods = current.periods if current is not None else ()
    in_force = period_at(next_sync, base=base, periods=periods)
    codec = None if base_codec is None else applied.config.codec
    codec_in_force = None if base_codec is None else codec_at(next_sync, base=base_codec, periods=periods)
    if (applied.config.inner_steps, codec) != (in_force, codec_in_force):
        periods = (*periods, Period(from_step=next_sync, inner_steps=applied.config.inner_steps, codec=codec))
    entry = TunedEntry(periods=periods, bandwidth_bps=measured.bandwidth_bps,
                       not_applied=not_applied(free, applied, fixed),
                       comm_cpu_s_per_byte=measured.comm_cpu_s_per_byte)
    return Decision(entry=entry, applied=applied, free=free, reason=reason)


def retune_reason(current: TunedEntry, measured: Measurements, *, factor: float) -> str | None:
    """Why to re-tune: the bandwidth or the communication CPU per byte moved by more than
    ``factor`` either way since the last tuning (a CPU cost first measured counts as moved);
    ``None``: neither did."""
    if needs_retune(current.bandwidth_bps, measured.bandwidth_bps, factor=factor):
        return (f"bandwidth {measured.bandwidth_bps / 1e6:.1f} Mbit/s, was {current.bandwidth_bps / 1e6:.1f} "
                f"Mbit/s at the last tuning (more than {factor:g}x)")
    was, now = current.comm_cpu_s_per_byte, measured.comm_cpu_s_per_byte
    if (was == 0 < now) or needs_retune(was, now, factor=factor):
        return (f"communication CPU {now * 1e9:.0f} ns/byte, was {was * 1e9:.0f} ns/byte at the last tuning "
                f"(more than {factor:g}x)")
    return None


def slowest_bandwidth_bps(last_sent: Mapping[str, tuple[int, float]], peers: Sequence[str]) -> float | None:
    """The slowest of ``peers``' last timed transfers (bytes, seconds), in bits per second."""
    rates = [size * 8 / seconds for peer in peers if (timed := last_sent.get(peer)) is not None
             for size, seconds in [timed] if seconds > 0]
    return min(rates) if rates else None
