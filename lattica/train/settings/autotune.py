"""Choosing H, the codec, overlap, group size and chunk size from measured links (sans-IO).

Theory of operation
-------------------
One outer round costs compute and communication. From what a node measures — the time of one
inner step, the model's fp32 payload, the bandwidth and round-trip time to its group's peers —
``predict`` models a round of a candidate configuration:

- compute: H × step time;
- transfer: the data plane's all-reduce over a group of n (``net/tensors/collectives.py``) is a
  reduce-scatter and an all-gather, two all-to-all phases: in each a member sends its n − 1
  parts of the encoded payload (``codec`` bits per value) at once, (n−1)/n of it, 2(n−1)/n in
  all; the data plane moves it in chunks, so a phase costs its bytes over the bandwidth (the
  parts share the uplink), one RTT, and a per-chunk overhead, and a chunk too large for the
  pipeline adds its own transfer time once per phase (fill);
- communication CPU: encoding, encryption, framing, copies and the reduction cost the node CPU
  time per byte it sends (``comm_cpu_s_per_byte``), and an exchange costs at least a floor per
  round whatever its size (``comm_cpu_s_per_round``: its phases' wake-ups of the event loop, the
  hand-offs of the GIL and of the cores) — max(floor, per byte × bytes sent), both measured on
  the node (``Measurements``). One measured round gives both: its cost is the floor, and its
  cost over its bytes the rate, so a smaller payload is not credited with CPU it was not seen
  to save, and a larger one pays in proportion;
- exposed communication, what a round adds to its compute:

  - blocking: the slower of the transfer and the communication CPU (the data plane pipelines
    chunks, so one chunk's CPU runs while the next is on the wire);
  - overlapped (eager DiLoCo or CO2: the round's all-reduce runs during the next H steps), cores shared
    with the inner steps (CPU training): the communication CPU is taken from the inner steps —
    the inner phase lasts compute + CPU — and the wire runs beside it, so the round lasts the
    longer of that and the transfer: exposed = max(CPU, transfer − compute);
  - overlapped, cores of its own (an accelerator computes): only what outlasts the inner phase,
    max(0, max(transfer, CPU) − compute);

- utilization = compute / (compute + exposed).

Overlap is not free on shared cores: a model that counted only the wire would predict 1.0 for
any exchange shorter than the inner phase while the exchange's CPU slows every step it overlaps.
The CPU term is what makes a longer H or a smaller codec worth its loss cost there — both divide
the CPU a step pays.

Every choice also has an expected loss cost, measured, relative to DiLoCo at H 50, fp32,
blocking (``loss_costs``: the tables per run length, read at the steps the run has left), and
few applied rounds cost more than the tables' sum (below).

The tuner wants the least expected loss cost among the configurations whose predicted
utilization meets the target (default 0.95) and whose loss cost is within the loss budget
(``max_loss``, default 3 %) — "prefer less compression and smaller H when both meet it" (ties:
less compression, then the smaller H). The priority search below runs within the budget (no move
past it); when it ends short, every candidate is checked, so a configuration that meets both is
found where one exists. Where none does, utilization comes first: the search without the budget,
and its last line says that no candidate meets both, with the best one within the budget. When
the utilization target itself is out of reach, the candidate of highest predicted utilization
is taken (ties: the least loss cost), and the last line says why.

The search is a priority search in the manner of Lagom (Xu et al., arXiv 2602.20656). The chunk
size costs no quality: it is set first, to the fastest transfer. Every other knob starts at its
cheapest value and moves one notch at a time: the knob that buys the most predicted utilization
per unit of loss cost — or, when some one-notch move meets the target, the cheapest such move,
and stops; a last pass backs off every notch the target no longer needs. Linear in the number of
values, where their product is exponential. Overlap switches the regime (the wire exposed when
blocking, the CPU when overlapped on shared cores), so one greedy path can commit to the wrong
one: the search runs once per regime — blocking, and each overlapped method (``eager``: eager
DiLoCo; ``co2``), whose late update costs differ per H (eager less at H <= 50, CO2 less above) —
and keeps the best. A gossip group overlaps with ``gossip_overlap``, eager's look-ahead: CO2 with
a group is no candidate (``runnable``). Every step is printed with
its numbers (``Choice.line``), so the choice explains itself, as OptiCo asks of a configurator
(Chen et al., ACL 2026).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from lattica.train.settings.loss_costs import LOSS_COST, cost_of, costs_per_h, loss_table

# bits per value on the wire, per codec (a per-block scale is negligible at these sizes)
CODEC_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}
# overlap: False (blocking) or the overlapped method — "eager" (eager DiLoCo, strategy ``eager``)
# or "co2" (strategy ``co2``); its loss cost is kept per method and per H (``loss_costs``)
OVERLAP_METHODS: tuple[object, ...] = (False, "eager", "co2")
DEFAULT_MAX_LOSS = 0.03  # the loss budget: expected loss cost a choice may carry (module docstring)
CHUNK_BYTES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
# the data plane's all-reduce (``net/tensors/collectives.py``): a reduce-scatter, then an
# all-gather, each one all-to-all phase in which a member sends its n − 1 parts at once
ALLREDUCE_PHASES = 2
PER_CHUNK_OVERHEAD_S = 0.002  # framing, a hand-off to the event loop, an acknowledgement
DEFAULT_TARGET = 0.95
PRIORITY = ("inner_steps", "codec", "overlap", "group_size")  # most influential first
DEFAULT_MIN_ROUNDS = 8  # applied outer rounds an H must leave the run to be a candidate
FEW_ROUNDS_LOSS = 0.08  # relative loss increase per 1 / applied rounds (module docstring)


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """What a node measured: its inner step, its payload and its links to the group's peers."""

    step_s: float  # one inner step
    model_bytes: int  # fp32 payload of the pseudo-gradient
    bandwidth_bps: float  # bits per second, the slowest peer's
    rtt_s: float  # round-trip time, the farthest peer's
    peers: int  # members of a round
    # CPU seconds per byte the node sends in an all-reduce (codec, encryption, framing, copies,
    # the reduction): a blocking round's process CPU over its bytes, or the inner steps' slow-down
    # during an overlapped round over its bytes (``comm_cpu_per_byte``); 0: not measured
    comm_cpu_s_per_byte: float = 0.0
    # the least an exchange costs per round, whatever its size (the measured round's cost)
    comm_cpu_s_per_round: float = 0.0
    shared_cores: bool = True  # the inner steps run on the cores communication runs on (CPU training)
    steps_left: int | None = None  # inner steps the run has left (None: unknown, rounds not counted)

    def __post_init__(self) -> None:
        for name in ("step_s", "bandwidth_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        for name in ("rtt_s", "comm_cpu_s_per_byte", "comm_cpu_s_per_round"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.model_bytes <= 0 or self.peers < 2:
            raise ValueError("model_bytes must be positive and peers at least 2")
        if self.steps_left is not None and (isinstance(self.steps_left, bool) or not isinstance(self.steps_left, int)
                                            or self.steps_left < 0):
            raise ValueError(f"steps_left must be an integer >= 0, got {self.steps_left!r}")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    inner_steps: int = 50
    codec: str = "fp32"
    overlap: object = False  # False, or the overlapped method: "eager" or "co2" (``OVERLAP_METHODS``)
    group_size: int = 0  # 0: every member of the round
    chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP_METHODS or self.overlap is True:
            raise ValueError(f"overlap must be one of {OVERLAP_METHODS}, got {self.overlap!r}")

    def describe(self) -> str:
        group = "all" if self.group_size == 0 else str(self.group_size)
        return (f"H {self.inner_steps}, {self.codec}, overlap {self.overlap or 'off'}, "
                f"group {group}, chunk {self.chunk_bytes >> 10} KiB")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    compute_s: float
    transfer_s: float
    comm_cpu_s: float
    exposed_s: float
    utilization: float
    loss_cost: float


def group_of(candidate: Candidate, peers: int) -> int:
    return peers if candidate.group_size == 0 else min(candidate.group_size, peers)


def sent_bytes(candidate: Candidate, m: Measurements) -> float:
    """What one member sends in a butterfly all-reduce: 2(n−1)/n of the encoded payload."""
    n = group_of(candidate, m.peers)
    return m.model_bytes * CODEC_BITS[candidate.codec] / 32 * 2 * (n - 1) / n


def transfer_seconds(candidate: Candidate, m: Measurements) -> float:
    """One all-reduce of the encoded payload over the candidate's group: two all-to-all phases
    (module docstring)."""
    n = group_of(candidate, m.peers)
    payload = m.model_bytes * CODEC_BITS[candidate.codec] / 32
    sent = sent_bytes(candidate, m)
    chunks = math.ceil(sent / candidate.chunk_bytes)
    fill = min(candidate.chunk_bytes, payload / n) * 8 / m.bandwidth_bps * ALLREDUCE_PHASES
    return sent * 8 / m.bandwidth_bps + ALLREDUCE_PHASES * m.rtt_s + chunks * PER_CHUNK_OVERHEAD_S + fill


def rounds_applied(candidate: Candidate, steps_left: int) -> int:
    """The outer updates a run with ``steps_left`` steps applies at the candidate's H: one a
    round, one fewer when overlapped (each lands a round late; the last never does)."""
    return max(0, steps_left // candidate.inner_steps - int(bool(candidate.overlap)))


def loss_cost(candidate: Candidate, steps_left: int | None = None) -> float:
    """The table of the run's length (``loss_table``), plus ``FEW_ROUNDS_LOSS`` per 1 / applied
    round when the steps left are known (none applied counts as half a round: worse than one)."""
    costs = loss_table(steps_left)
    table = sum(cost_of(costs[knob][getattr(candidate, knob)]) for knob in PRIORITY if knob != "overlap")
    if candidate.overlap:  # a round late costs less the longer the round (measured per method, per H)
        at_h = costs_per_h(costs["overlap_at_h"][candidate.overlap])
        table += at_h.get(candidate.inner_steps, cost_of(costs["overlap"][candidate.overlap]))
    if steps_left is None:
        return table
    return table + FEW_ROUNDS_LOSS / max(rounds_applied(candidate, steps_left), 0.5)


def exposed_seconds(*, compute: float, transfer: float, cpu: float, overlap: bool, shared_cores: bool) -> float:
    """What a round's communication adds to its compute (module docstring)."""
    if not overlap:
        return max(transfer, cpu)
    if shared_cores:
        return max(cpu, transfer - compute)
    return max(0.0, max(transfer, cpu) - compute)


def predict(candidate: Candidate, m: Measurements) -> Prediction:
    compute = candidate.inner_steps * m.step_s
    transfer = transfer_seconds(candidate, m)
    cpu = max(m.comm_cpu_s_per_round, sent_bytes(candidate, m) * m.comm_cpu_s_per_byte)
    exposed = exposed_seconds(compute=compute, transfer=transfer, cpu=cpu, overlap=bool(candidate.overlap),
                              shared_cores=m.shared_cores)
    return Prediction(
        compute_s=compute, transfer_s=transfer, comm_cpu_s=cpu, exposed_s=exposed,
        utilization=compute / (compute + exposed), loss_cost=loss_cost(candidate, m.steps_left),
    )


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One step of the search: a knob set to a value, and the numbers behind it."""

    knob: str
    value: object
    prediction: Prediction
    reason: str

    def line(self) -> str:
        p = self.prediction
        return (f"{self.knob} = {self.value}: utilization {p.utilization:.3f} (compute {p.compute_s:.2f} s, "
                f"transfer {p.transfer_s:.2f} s, comm CPU {p.comm_cpu_s:.2f} s, exposed {p.exposed_s:.2f} s), "
                f"expected loss {100 * p.loss_cost:+.1f} % — {self.reason}")


@dataclass(frozen=True, kw_only=True)
class Tuned:
    config: Candidate
    prediction: Prediction
    choices: tuple[Choice, ...]
    meets_target: bool  # the utilization target
    shortfall: str = ""  # why a target was not reachable ("" when both were met)
    within_loss_budget: bool = True  # the expected loss cost is within ``max_loss``


def _values(knob: str, fixed: Mapping[str, object], steps: int | None) -> list[object]:
    """A knob's values from the cheapest in loss to the dearest at the run's length (ties: the
    smaller H first); only its value in ``fixed`` when the run cannot change it."""
    if knob in fixed:
        if fixed[knob] not in LOSS_COST[knob]:
            raise ValueError(f"{knob} = {fixed[knob]!r} is not one of {sorted(LOSS_COST[knob], key=str)}")
        return [fixed[knob]]
    costs = loss_table(steps)[knob]
    return sorted(costs, key=lambda v: (cost_of(costs[v]), v if isinstance(v, int) and knob == "inner_steps" else 0))


def tune(
    m: Measurements, *, target: float = DEFAULT_TARGET, fixed: Mapping[str, object] | None = None,
    min_rounds: int = DEFAULT_MIN_ROUNDS, max_loss: float = DEFAULT_MAX_LOSS,
) -> Tuned:
    """The least expected loss cost meeting both ``target`` and the loss budget ``max_loss``
    (module docstring): the priority search within the budget, checked against every candidate
    when it misses; when none meets both, utilization first, and the last line says so.
    ``fixed``: knobs held at a value (those a running swarm cannot change); ``min_rounds``: the
    applied rounds an H must leave in ``m.steps_left`` (when known)."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if isinstance(min_rounds, bool) or not isinstance(min_rounds, int) or min_rounds < 0:
        raise ValueError(f"min_rounds must be an integer >= 0, got {min_rounds!r}")
    if not max_loss >= 0:
        raise ValueError(f"max_loss must be a number >= 0 (inf: no budget), got {max_loss!r}")
    fixed = dict(fixed or {})
    budgeted = _regimes(m, target, fixed, min_rounds, max_loss)
    if budgeted.meets_target and budgeted.prediction.loss_cost <= max_loss:
        return budgeted
    values = _allowed(m, fixed, min_rounds)
    predicted = [(c, predict(c, m)) for c in _candidates(values, m)]
    meeting = [c for c, p in predicted if p.utilization >= target and p.loss_cost <= max_loss]
    if meeting:
        best = min(meeting, key=lambda c: (predict(c, m).loss_cost, list(CODEC_BITS).index(c.codec), c.inner_steps))
        p = predict(best, m)
        last = Choice(knob="checked", value=best.describe(), prediction=p,
                      reason="the least loss cost of every candidate that meets both targets")
        return Tuned(config=best, prediction=p, choices=(*budgeted.choices, last), meets_target=True)
    free = _regimes(m, target, fixed, min_rounds, math.inf)
    bp = budgeted.prediction
    why = (f"no candidate meets both utilization {target} and expected loss <= +{100 * max_loss:.1f} % (within "
           f"that loss the best is {budgeted.config.describe()}, utilization {bp.utilization:.3f}, expected loss "
           f"{100 * bp.loss_cost:+.1f} %); utilization first")
    shortfall = f"{free.shortfall}; {why}" if free.shortfall else why
    last = Choice(knob="loss budget", value=max_loss, prediction=free.prediction, reason=shortfall)
    return Tuned(config=free.config, prediction=free.prediction, choices=(*free.choices, last),
                 meets_target=free.meets_target, shortfall=shortfall,
                 within_loss_budget=free.prediction.loss_cost <= max_loss)


def _regimes(m: Measurements, target: float, fixed: dict[str, object], min_rounds: int, max_loss: float) -> Tuned:
    """The priority search once per regime (blocking, and each overlapped method) when overlap
    is free: the cheapest result meeting the target (else the higher utilization), with a last
    line that names where the others end."""
    if "overlap" in fixed:
        return _search(m, target=target, fixed=fixed, min_rounds=min_rounds, max_loss=max_loss)
    results = [_search(m, target=target, fixed={**fixed, "overlap": o}, min_rounds=min_rounds, max_loss=max_loss)
               for o in _overlaps(fixed)]
    best = results[0]
    for result in results[1:]:
        if _better(result, best, max_loss):
            best = result
    verdicts = [
        f"with overlap {other.config.overlap or 'off'} the search ends at {other.config.describe()}, utilization "
        f"{other.prediction.utilization:.3f}, expected loss {100 * other.prediction.loss_cost:+.1f} %"
        for other in results if other is not best
    ]
    reason = f"the better regime: {'; '.join(verdicts)}"
    if best.shortfall:
        reason = f"{best.shortfall}; {reason}"
    last = Choice(knob="overlap", value=best.config.overlap, prediction=best.prediction, reason=reason)
    return Tuned(config=best.config, prediction=best.prediction, choices=(*best.choices, last),
                 meets_target=best.meets_target, shortfall=best.shortfall)


def _overlaps(fixed: Mapping[str, object]) -> list[object]:
    """The overlap values a run may take: with a gossip group (``group_size`` fixed above 0)
    overlap is ``gossip_overlap``, eager's look-ahead — CO2 runs over all-reduce only."""
    gossip = fixed.get("group_size", 0) != 0
    return [o for o in OVERLAP_METHODS if not (gossip and o == "co2")]


def _better(a: Tuned, b: Tuned, max_loss: float) -> bool:
    """Whether ``a`` is the better result: meeting the target within the loss budget at less
    loss cost; else the higher utilization within the budget; else the higher utilization."""
    def rank(t: Tuned) -> tuple[int, float]:
        p = t.prediction
        if p.loss_cost > max_loss:
            return (0, p.utilization)
        return (2, -p.loss_cost) if t.meets_target else (1, p.utilization)

    return rank(a) > rank(b)


def _enough_rounds(hs: list[object], overlaps: list[object], m: Measurements, min_rounds: int) -> list[object]:
    """The values of H that leave at least ``min_rounds`` applied rounds in every regime
    searched; the smallest H alone when none does; all of them when the steps left are unknown."""
    if m.steps_left is None:
        return hs
    steps, ints = m.steps_left, [h for h in hs if isinstance(h, int)]
    allowed = [h for h in ints if all(rounds_applied(Candidate(inner_steps=h, overlap=o), steps) >= min_rounds
                                      for o in overlaps)]
    return list(allowed or [min(ints)])


def _why_unreachable(target: float, hs: list[object], overlaps: list[object], m: Measurements,
                     min_rounds: int) -> str:
    """The explanation of a search that cannot meet ``target`` within the rounds constraint."""
    if m.steps_left is None:
        return f"target {target} not reachable: no value of the knobs the run may change reaches it"
    late = " (an overlapped update lands a round late: one round fewer)" if any(bool(o) for o in overlaps) else ""
    h = max(v for v in hs if isinstance(v, int))
    overlapped = next((o for o in overlaps if o), False)
    if rounds_applied(Candidate(inner_steps=h, overlap=overlapped), m.steps_left) < min_rounds:
        limit = f"even H {h} leaves fewer than {min_rounds} applied rounds in the {m.steps_left} steps left{late}"
    else:
        limit = f"at least {min_rounds} applied rounds in the {m.steps_left} steps left allow H <= {h}{late}"
    return f"target {target} not reachable: {limit}; the highest predicted utilization within that is chosen"


def _allowed(m: Measurements, fixed: Mapping[str, object], min_rounds: int) -> dict[str, list[object]]:
    """Each knob's values, cheapest first, H within the rounds constraint."""
    values = {knob: _values(knob, fixed, m.steps_left) for knob in PRIORITY}
    return {**values, "inner_steps": _enough_rounds(values["inner_steps"], values["overlap"], m, min_rounds)}


def _candidates(values: Mapping[str, list[object]], m: Measurements) -> list[Candidate]:
    """Every combination of ``values``, each at its fastest chunk size (a few hundred)."""
    out = []
    for combo in itertools.product(*(values[k] for k in PRIORITY)):
        base = Candidate(**dict(zip(PRIORITY, combo, strict=True)))  # type: ignore[arg-type]
        if not runnable(base):
            continue
        chunk = min(CHUNK_BYTES, key=lambda c: transfer_seconds(replace(base, chunk_bytes=c), m))
        out.append(replace(base, chunk_bytes=chunk))
    return out


def _best_utilization(values: Mapping[str, list[object]], m: Measurements, max_loss: float) -> Candidate:
    """The candidate of highest predicted utilization over ``values`` within the loss budget
    (ties: the least loss cost; none within it: the least loss cost); exhaustive, for the case
    no candidate meets the target."""
    candidates = _candidates(values, m)
    within = [c for c in candidates if predict(c, m).loss_cost <= max_loss]
    if not within:  # every candidate is past the budget: the least loss cost
        return min(candidates, key=lambda c: (predict(c, m).loss_cost, -predict(c, m).utilization))
    return max(within, key=lambda c: (predict(c, m).utilization, -predict(c, m).loss_cost))


def _search(m: Measurements, *, target: float, fixed: Mapping[str, object], min_rounds: int,
            max_loss: float) -> Tuned:
    """One priority search (module docstring): the chunk size first, then one notch at a time
    on the knob that buys the most utilization per unit of loss cost, then back off what the
    target no longer needs; the highest utilization within the rounds constraint when the
    target is not reachable. No move takes the loss cost past ``max_loss``."""
    values = _allowed(m, fixed, min_rounds)
    index = dict.fromkeys(PRIORITY, 0)

    def at(idx: dict[str, int], chunk: int) -> Candidate:
        return Candidate(chunk_bytes=chunk, **{k: values[k][i] for k, i in idx.items()})  # type: ignore[arg-type]

    chunk = min(CHUNK_BYTES, key=lambda c: transfer_seconds(at(index, c), m))
    current = at(index, chunk)
    choices = [Choice(knob="chunk_bytes", value=chunk, prediction=predict(current, m),
                      reason="the fastest transfer of " + ", ".join(f"{c >> 10} KiB" for c in CHUNK_BYTES))]
    while predict(current, m).utilization < target:
        moves = []
        for knob in PRIORITY:
            if index[knob] + 1 < len(values[knob]):
                moved = at({**index, knob: index[knob] + 1}, chunk)
                if runnable(moved) and (p := predict(moved, m)).loss_cost <= max_loss:
                    moves.append((knob, moved, p))
        if not moves:
            break
        now = predict(current, m)
        meeting = [mv for mv in moves if mv[2].utilization >= target]
        if meeting:
            knob, current, prediction = min(meeting, key=lambda mv: mv[2].loss_cost)
            reason = f"meets utilization {target} at the least loss cost of one step"
        else:
            knob, current, prediction = max(moves, key=lambda mv: _worth(mv[2], now))
            reason = "the most utilization per loss cost of one step"
        index[knob] += 1
        choices.append(Choice(knob=knob, value=getattr(current, knob), prediction=prediction, reason=reason))
    for knob in PRIORITY:  # back off: a step taken early that the later ones made unneeded
        while index[knob] > 0:
            lighter = at({**index, knob: index[knob] - 1}, chunk)
            prediction = predict(lighter, m)
            if not runnable(lighter) or prediction.utilization < target:
                break
            index[knob] -= 1
            current = lighter
            choices.append(Choice(knob=knob, value=getattr(current, knob), prediction=prediction,
                                  reason=f"backed off: {target} is met without it"))
    final = predict(current, m)
    if final.utilization >= target:
        return Tuned(config=current, prediction=final, choices=tuple(choices), meets_target=True)
    shortfall = _why_unreachable(target, values["inner_steps"], values["overlap"], m, min_rounds)
    current = _best_utilization(values, m, max_loss)
    final = predict(current, m)
    choices.append(Choice(knob="target", value=target, prediction=final,
                          reason=f"{shortfall}: {current.describe()}"))
    return Tuned(config=current, prediction=final, choices=tuple(choices), meets_target=False, shortfall=shortfall)


def _worth(moved: Prediction, now: Prediction) -> float:
    """Utilization bought per unit of loss cost by a move from ``now``."""
    return (moved.utilization - now.utilization) / max(moved.loss_cost - now.loss_cost, 1e-4)


def comm_cpu_per_byte(*, cpu_s: float, bytes_sent: float) -> float:
    """CPU seconds per byte sent: a blocking round's process CPU (the inner steps wait, so what
    the process spends is the exchange's) over the bytes it sent; 0 without bytes."""
    return max(0.0, cpu_s) / bytes_sent if bytes_sent > 0 else 0.0


def slowdown_cpu_per_byte(*, step_s: float, clean_step_s: float, steps: int, bytes_sent: float) -> float:
    """CPU seconds per byte sent: the time an overlapped exchange took from the ``steps`` it ran
    beside (``step_s`` against ``clean_step_s``, no exchange in flight), over its bytes — what
    a process's own CPU time misses on shared cores (the GIL, other processes' share)."""
    if bytes_sent <= 0 or steps <= 0:
        return 0.0
    return max(0.0, step_s - clean_step_s) * steps / bytes_sent


def needs_retune(tuned_for_bps: float, measured_bps: float, *, factor: float = 2.0) -> bool:
    """Whether the bandwidth moved by more than ``factor`` either way since the last tuning."""
    if tuned_for_bps <= 0 or measured_bps <= 0:
        return False
    ratio = measured_bps / tuned_for_bps
    return ratio > factor or ratio < 1 / factor


def runnable(candidate: Candidate) -> bool:
    """Whether a run can take ``candidate``: CO2 runs over all-reduce only (a gossip group
    overlaps with ``gossip_overlap``, eager's look-ahead)."""
    return not (candidate.group_size and candidate.overlap == "co2")


def run_settings(candidate: Candidate) -> dict[str, object]:
    """The ``[train]`` settings of ``candidate``: overlap is its method's strategy, ``eager`` or
    ``co2`` (all-reduce), or gossip with ``gossip_overlap``; a group smaller than the round is
    gossip averaging; the codec is the run setting ``codec``. The chunk size is the data plane's
    own (advisory here)."""
    settings: dict[str, object] = {"inner_steps": candidate.inner_steps}
    if candidate.codec != "fp32":
        settings["codec"] = candidate.codec
    if candidate.group_size:
        settings |= {"strategy": "diloco", "averaging": "gossip", "group_size": candidate.group_size}
        if candidate.overlap:
            settings["gossip_overlap"] = True
    else:
        settings["strategy"] = str(candidate.overlap) if candidate.overlap else "diloco"
    return settings
