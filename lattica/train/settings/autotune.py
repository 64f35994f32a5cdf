"""Choosing H, the codec, overlap, group size and chunk size from measured links (sans-IO).

Theory of operation
-------------------
One outer round costs compute and communication. From what a node measures — the time of one
inner step, the model's fp32 payload, the bandwidth and round-trip time to its group's peers —
``predict`` models a round of a candidate configuration:

- compute: H × step time;
- transfer: a butterfly all-reduce over a group of n sends 2(n−1)/n of the encoded payload
  (``codec`` bits per value) per member in 2(n−1) sequential phases; the data plane moves it in
  chunks, so a phase costs its bytes over the bandwidth, one RTT, and a per-chunk overhead, and
  a chunk too large for the pipeline adds its own transfer time once per phase (fill);
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
  - overlapped (eager / CO2: the round's all-reduce runs during the next H steps), cores shared
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

Every choice also has an expected loss cost, a relative loss increase taken from this
project's own convergence measurements (``LOSS_COST``; docs/strategies.md): a longer H, a lossier
codec, overlap (a one-round-late update) and a smaller group each cost a little quality. The
search wants the configuration with the least loss cost whose predicted utilization meets the
target (default 0.95) — "prefer less compression and smaller H when both meet it".

The table was measured on runs of many rounds; what a longer H costs depends on how many outer
rounds the run has left to do (``Measurements.steps_left`` ÷ H; an overlapped update lands one
round late, so it counts one round fewer — the last exchange is never applied). Few rounds cost
far more than the table's sum: CO2 at H 200 on a 400-step run (two rounds, one applied) came out
+13.6 % against DiLoCo H 50, worse than no communication (+3.1 %), where the table said +3.5 %.
So when the steps left are known:

- an H that leaves fewer than ``min_rounds`` (default ``DEFAULT_MIN_ROUNDS`` = 8) applied rounds
  is no candidate (``rounds_applied``); when even the smallest H leaves fewer, only the smallest
  is kept;
- every candidate's loss cost adds ``FEW_ROUNDS_LOSS`` ÷ applied rounds (fitted to that run: one
  applied round, +8 % beyond the table's +3.5 %), which is small over hundreds of rounds and
  grows as they fall.

When no candidate within that constraint meets the target, the search picks the one of highest
predicted utilization within it (ties: the least loss cost), and its last line says the target
was not reachable and why.

The search is a priority search in the manner of Lagom (Xu et al., arXiv 2602.20656), not an
exhaustive one. The chunk size costs no quality: it is set first, to the value that minimizes
the transfer. Every other knob starts at its cheapest value (its values ordered from the
cheapest in loss to the dearest) and moves one notch at a time: each step moves the knob of
highest priority — the most predicted utilization bought per unit of expected loss cost — or,
when some one-notch move meets the target, the cheapest such move, and stops. A last pass backs
off every knob whose last notch the target no longer needs. Each knob moves through its values
at most once each way, so the search is linear in the number of values, where the cross
product of the knobs is exponential. Overlap switches the regime — what is exposed is the wire
when blocking, the CPU when overlapped on shared cores — so one greedy path can commit to the
wrong one (a longer H bought while blocking, where overlap and a smaller codec were cheaper):
the search runs once with overlap off and once with it on, and keeps the cheaper result that
meets the target (twice linear). Every step is printed with its numbers (``Choice.line``), so the choice
explains itself, as OptiCo asks of a configurator (Chen et al., ACL 2026).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

# bits per value on the wire, per codec (a per-block scale is negligible at these sizes)
CODEC_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}
# expected relative loss increase of each choice against DiLoCo H = 50, fp32, blocking, all peers
LOSS_COST: dict[str, dict[object, float]] = {
    "inner_steps": {25: 0.0, 50: 0.0, 100: 0.01, 200: 0.025, 400: 0.05},
    "codec": {"fp32": 0.0, "bf16": 0.001, "int8": 0.003, "int4": 0.01},
    "overlap": {False: 0.0, True: 0.01},
    "group_size": {0: 0.0, 4: 0.005, 2: 0.02},  # 0: every member of the round
}
CHUNK_BYTES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
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
    overlap: bool = False
    group_size: int = 0  # 0: every member of the round
    chunk_bytes: int = 1 << 20

    def describe(self) -> str:
        group = "all" if self.group_size == 0 else str(self.group_size)
        return (f"H {self.inner_steps}, {self.codec}, overlap {'on' if self.overlap else 'off'}, "
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
    """One all-reduce of the encoded payload over the candidate's group (module docstring)."""
    n = group_of(candidate, m.peers)
    payload = m.model_bytes * CODEC_BITS[candidate.codec] / 32
    phases = 2 * (n - 1)
    sent = sent_bytes(candidate, m)
    chunks = math.ceil(sent / candidate.chunk_bytes)
    fill = min(candidate.chunk_bytes, payload / n) * 8 / m.bandwidth_bps * phases
    return sent * 8 / m.bandwidth_bps + phases * m.rtt_s + chunks * PER_CHUNK_OVERHEAD_S + fill


def rounds_applied(candidate: Candidate, steps_left: int) -> int:
    """The outer updates a run with ``steps_left`` steps applies at the candidate's H: one a
    round, one fewer when overlapped (each lands a round late; the last never does)."""
    return max(0, steps_left // candidate.inner_steps - int(candidate.overlap))


def loss_cost(candidate: Candidate, steps_left: int | None = None) -> float:
    """The table's costs, plus ``FEW_ROUNDS_LOSS`` per 1 / applied round when the steps left
    are known (none applied counts as half a round: worse than one)."""
    table = sum(LOSS_COST[knob][getattr(candidate, knob)] for knob in PRIORITY)
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
    exposed = exposed_seconds(compute=compute, transfer=transfer, cpu=cpu, overlap=candidate.overlap,
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
                f"expected loss +{100 * p.loss_cost:.1f} % — {self.reason}")


@dataclass(frozen=True, kw_only=True)
class Tuned:
    config: Candidate
    prediction: Prediction
    choices: tuple[Choice, ...]
    meets_target: bool
    shortfall: str = ""  # why the target was not reachable ("" when met)


def _values(knob: str, fixed: Mapping[str, object]) -> list[object]:
    """A knob's values from the cheapest in loss to the dearest (ties: the smaller H first);
    only its value in ``fixed`` when the run cannot change it."""
    if knob in fixed:
        if fixed[knob] not in LOSS_COST[knob]:
            raise ValueError(f"{knob} = {fixed[knob]!r} is not one of {sorted(LOSS_COST[knob], key=str)}")
        return [fixed[knob]]
    costs = LOSS_COST[knob]
    return sorted(costs, key=lambda v: (costs[v], v if isinstance(v, int) and knob == "inner_steps" else 0))


def tune(
    m: Measurements, *, target: float = DEFAULT_TARGET, fixed: Mapping[str, object] | None = None,
    min_rounds: int = DEFAULT_MIN_ROUNDS,
) -> Tuned:
    """The priority search (module docstring), once per regime when overlap is free: the
    cheapest result meeting the target (else the higher utilization), with a last line that
    names the other. ``fixed``: knobs held at a value (those a running swarm cannot change);
    ``min_rounds``: the applied rounds an H must leave in ``m.steps_left`` (when known)."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if isinstance(min_rounds, bool) or not isinstance(min_rounds, int) or min_rounds < 0:
        raise ValueError(f"min_rounds must be an integer >= 0, got {min_rounds!r}")
    fixed = dict(fixed or {})
    if "overlap" in fixed:
        return _search(m, target=target, fixed=fixed, min_rounds=min_rounds)
    off, on = (_search(m, target=target, fixed={**fixed, "overlap": o}, min_rounds=min_rounds) for o in (False, True))
    best, other = (on, off) if _better(on, off) else (off, on)
    p = other.prediction
    verdict = (f"with overlap {'on' if other.config.overlap else 'off'} the search ends at "
               f"{other.config.describe()}, utilization {p.utilization:.3f}, expected loss +{100 * p.loss_cost:.1f} %")
    reason = f"the better regime: {verdict}"
    if best.shortfall:
        reason = f"{best.shortfall}; {reason}"
    last = Choice(knob="overlap", value=best.config.overlap, prediction=best.prediction, reason=reason)
    return Tuned(config=best.config, prediction=best.prediction, choices=(*best.choices, last),
                 meets_target=best.meets_target, shortfall=best.shortfall)


def _better(a: Tuned, b: Tuned) -> bool:
    """Whether ``a`` is the better result: meeting the target at less loss cost, or the higher
    utilization when neither meets it."""
    if a.meets_target != b.meets_target:
        return a.meets_target
    if a.meets_target:
        return a.prediction.loss_cost < b.prediction.loss_cost
    return a.prediction.utilization > b.prediction.utilization


def _enough_rounds(hs: list[object], overlaps: list[object], m: Measurements, min_rounds: int) -> list[object]:
    """The values of H that leave at least ``min_rounds`` applied rounds in every regime
    searched; the smallest H alone when none does; all of them when the steps left are unknown."""
    if m.steps_left is None:
        return hs
    steps, ints = m.steps_left, [h for h in hs if isinstance(h, int)]
    allowed = [h for h in ints if all(rounds_applied(Candidate(inner_steps=h, overlap=bool(o)), steps) >= min_rounds
                                      for o in overlaps)]
    return list(allowed or [min(ints)])


def _why_unreachable(target: float, hs: list[object], overlaps: list[object], m: Measurements,
                     min_rounds: int) -> str:
    """The explanation of a search that cannot meet ``target`` within the rounds constraint."""
    if m.steps_left is None:
        return f"target {target} not reachable: no value of the knobs the run may change reaches it"
    late = " (an overlapped update lands a round late: one round fewer)" if any(bool(o) for o in overlaps) else ""
    h = max(v for v in hs if isinstance(v, int))
    if rounds_applied(Candidate(inner_steps=h, overlap=any(bool(o) for o in overlaps)), m.steps_left) < min_rounds:
        limit = f"even H {h} leaves fewer than {min_rounds} applied rounds in the {m.steps_left} steps left{late}"
    else:
        limit = f"at least {min_rounds} applied rounds in the {m.steps_left} steps left allow H <= {h}{late}"
    return f"target {target} not reachable: {limit}; the highest predicted utilization within that is chosen"


def _best_utilization(values: Mapping[str, list[object]], m: Measurements) -> Candidate:
    """The candidate of highest predicted utilization over ``values`` (ties: the least loss
    cost), each at its fastest chunk size; exhaustive, for the case no candidate meets the
    target (a few hundred predictions)."""
    best: tuple[float, float] | None = None
    chosen = Candidate()
    for combo in itertools.product(*(values[k] for k in PRIORITY)):
        base = Candidate(**dict(zip(PRIORITY, combo, strict=True)))  # type: ignore[arg-type]
        chunk = min(CHUNK_BYTES, key=lambda c: transfer_seconds(replace(base, chunk_bytes=c), m))
        candidate = replace(base, chunk_bytes=chunk)
        p = predict(candidate, m)
        if best is None or (p.utilization, -p.loss_cost) > best:
            best, chosen = (p.utilization, -p.loss_cost), candidate
    return chosen


def _search(m: Measurements, *, target: float, fixed: Mapping[str, object], min_rounds: int) -> Tuned:
    """One priority search (module docstring): the chunk size first, then one notch at a time
    on the knob that buys the most utilization per unit of loss cost, then back off what the
    target no longer needs; the highest utilization within the rounds constraint when the
    target is not reachable."""
    values = {knob: _values(knob, fixed) for knob in PRIORITY}
    values["inner_steps"] = _enough_rounds(values["inner_steps"], values["overlap"], m, min_rounds)
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
                moves.append((knob, moved, predict(moved, m)))
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
            if prediction.utilization < target:
                break
            index[knob] -= 1
            current = lighter
            choices.append(Choice(knob=knob, value=getattr(current, knob), prediction=prediction,
                                  reason=f"backed off: {target} is met without it"))
    final = predict(current, m)
    if final.utilization >= target:
        return Tuned(config=current, prediction=final, choices=tuple(choices), meets_target=True)
    shortfall = _why_unreachable(target, values["inner_steps"], values["overlap"], m, min_rounds)
    current = _best_utilization(values, m)
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
    """CPU seconds per byte sent, from the inner steps of an overlapped phase (``step_s``) against
    steps with no exchange in flight (``clean_step_s``): the time the exchange took from the
    ``steps`` it overlapped, over its bytes. This counts what a process's own CPU time misses on
    shared cores — the GIL handed back and forth, other processes' share of the cores."""
    if bytes_sent <= 0 or steps <= 0:
        return 0.0
    return max(0.0, step_s - clean_step_s) * steps / bytes_sent


def needs_retune(tuned_for_bps: float, measured_bps: float, *, factor: float = 2.0) -> bool:
    """Whether the bandwidth moved by more than ``factor`` either way since the last tuning."""
    if tuned_for_bps <= 0 or measured_bps <= 0:
        return False
    ratio = measured_bps / tuned_for_bps
    return ratio > factor or ratio < 1 / factor


def run_settings(candidate: Candidate) -> dict[str, object]:
    """The ``[train]`` settings of ``candidate``: overlap is strategy ``co2`` (all-reduce) or
    gossip with ``gossip_overlap``; a group smaller than the round is gossip averaging; the codec
    is the run setting ``codec``. The chunk size is the data plane's own (advisory here)."""
    settings: dict[str, object] = {"inner_steps": candidate.inner_steps}
    if candidate.codec != "fp32":
        settings["codec"] = candidate.codec
    if candidate.group_size:
        settings |= {"strategy": "diloco", "averaging": "gossip", "group_size": candidate.group_size}
        if candidate.overlap:
            settings["gossip_overlap"] = True
    else:
        settings["strategy"] = "co2" if candidate.overlap else "diloco"
    return settings
