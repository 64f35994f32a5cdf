"""What each tuning choice costs in loss, as measured (the tables ``autotune`` reads).

Every choice also has an expected loss cost, a relative loss increase against DiLoCo at H 50,
fp32, blocking, measured with this project's convergence benchmark (``LOSS_COST_AT``,
docs/strategies.md "What a choice costs in loss"): a longer H, a lossier codec, overlap (a
one-round-late update) and a smaller group each cost some quality, and the costs add. They
depend on the run's length: the same H and overlap cost 3–6× more over 2,000 steps than over
500, so the table is kept per measured length and read at the steps the run has left
(``loss_table``: linear in log(steps) between two lengths, the nearest outside them, the
longest when unknown). And few rounds cost more than the table's sum (CO2 at H 200 on a 400-step
run, one applied round: +13.6 %), so when the steps left are known (an overlapped update counts
one round fewer: the last is never applied) an H that leaves fewer than ``min_rounds`` (8)
applied rounds is no candidate (only the smallest H when none leaves that many), and every
candidate adds ``FEW_ROUNDS_LOSS`` ÷ applied rounds (fitted to that run).

A table maps a knob to its values' costs; ``overlap`` holds each overlapped method's cost at
H 50 and ``overlap_at_h`` its cost per H (the method's own measurements at each H, over DiLoCo
at that H; an H not measured falls back to ``overlap``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

Cost = float | dict[int, float]  # a value's cost, or (``overlap_at_h``) a method's cost per H
LossTable = dict[str, dict[object, Cost]]  # knob -> value -> cost

# expected relative loss increase of each choice against DiLoCo H = 50, fp32, blocking, all peers,
# measured on runs of the keyed length (docs/strategies.md, "What a choice costs in loss");
# overlap: False (blocking) or the overlapped method, "eager" or "co2"
LOSS_COST_AT: dict[int, LossTable] = {
    500: {
        "inner_steps": {25: -0.013, 50: 0.0, 100: 0.026, 200: 0.032, 400: 0.05},
        "codec": {"fp32": 0.0, "bf16": 0.001, "int8": 0.003, "int4": 0.01},
        "overlap": {False: 0.0, "eager": 0.031, "co2": 0.009},
        "overlap_at_h": {  # each method's cost at each H
            # convergence.py --steps 500 … --strategies eager --set eager.inner_steps=H: val loss
            # 2.2159 / 2.2805 / 2.3529 / 2.5317 at H 25 / 50 / 100 / 200, over DiLoCo at that H
            # (H 400 not run: H 200's)
            "eager": {25: 0.015, 50: 0.031, 100: 0.038, 200: 0.112, 400: 0.112},
            "co2": {25: 0.018, 50: 0.009, 100: 0.01, 200: 0.01, 400: 0.01},
        },
        "group_size": {0: 0.0, 4: 0.005, 2: 0.02},  # 0: every member of the round
    },
    2000: {
        "inner_steps": {25: -0.034, 50: 0.0, 100: 0.047, 200: 0.084, 400: 0.15},
        "codec": {"fp32": 0.0, "bf16": 0.0, "int8": 0.0, "int4": 0.0},  # int4 measured -0.7 %: none
        "overlap": {False: 0.0, "eager": 0.053, "co2": 0.064},
        "overlap_at_h": {
            # convergence.py --steps 2000 --lr 1e-3 --warmup 20 --threads 1 --strategies eager
            # --set eager.inner_steps=H: 1.8028 / 1.8523 / 1.9339 / 1.9983 at H 25 / 50 / 100 /
            # 200, over DiLoCo at that H (1.6982 / 1.7586 / 1.8409 / 1.9069; H 400: H 200's)
            "eager": {25: 0.059, 50: 0.053, 100: 0.053, 200: 0.052, 400: 0.052},
            "co2": {25: 0.096, 50: 0.064, 100: 0.047, 200: 0.041, 400: 0.041},
        },
        "group_size": {0: 0.0, 4: 0.005, 2: 0.02},
    },
}
LOSS_COST = LOSS_COST_AT[max(LOSS_COST_AT)]  # the longest run measured: a run of unknown length


def cost_of(entry: Cost) -> float:
    """A knob value's cost (not a per-H table)."""
    if isinstance(entry, dict):
        raise TypeError("a per-H table where a knob value's cost was expected")
    return entry


def costs_per_h(entry: Cost) -> dict[int, float]:
    """An overlapped method's cost per H (``overlap_at_h``)."""
    if not isinstance(entry, dict):
        raise TypeError("a knob value's cost where a per-H table was expected")
    return entry


def loss_table(steps: int | None) -> LossTable:
    """``LOSS_COST_AT`` for a run of ``steps``: the measured table at a measured length, linear in
    log(steps) between two, the nearest outside them; the longest when ``steps`` is unknown."""
    lengths = sorted(LOSS_COST_AT)
    if steps is None or steps >= lengths[-1]:
        return LOSS_COST_AT[lengths[-1]]
    if steps <= lengths[0]:
        return LOSS_COST_AT[lengths[0]]
    low, high = max(n for n in lengths if n <= steps), min(n for n in lengths if n > steps)
    w, a, b = math.log(steps / low) / math.log(high / low), LOSS_COST_AT[low], LOSS_COST_AT[high]
    return {knob: {v: _between_costs(a[knob][v], b[knob][v], w) for v in b[knob]} for knob in b}


def _between_costs(a: Cost, b: Cost, w: float) -> Cost:
    """(1 − w)·a + w·b (per H for a per-H table)."""
    if isinstance(b, dict):
        return _between(costs_per_h(a), b, w)
    return (1 - w) * cost_of(a) + w * b


K = TypeVar("K")


def _between(a: Mapping[K, float], b: Mapping[K, float], w: float) -> dict[K, float]:
    return {v: (1 - w) * a[v] + w * b[v] for v in b}
