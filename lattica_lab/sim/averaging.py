"""Gossip averaging of a vector per peer over the product's group draw.

Training is a vector per peer: each round every live replica adds a pseudo-gradient (a drift
shared by all plus its own noise), then averages with its group. Groups are the product's:
``groups.proposed_group`` from each peer's view of the live members (``draw_step_groups`` once
per distinct view: every peer holding the same view draws the same stripes), confirmed pairwise
(``groups.confirmed_group``: a partner counts when its own proposal holds this peer; a dead
partner never answers). A confirmed group replaces each member's vector with the group's mean.

The spread is ``sqrt(mean_i |x_i - mean x|^2)``, the root-mean-square distance of the replicas
from their mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lattica.coordination.groups import confirmed_group, draw_step_groups


def spread(vectors: Mapping[str, np.ndarray]) -> float:
    stack = np.stack(list(vectors.values()))
    return float(np.sqrt(((stack - stack.mean(axis=0)) ** 2).sum(axis=1).mean()))


def gossip_round(
    vectors: dict[str, np.ndarray], views: Mapping[str, Sequence[str]], *, key: str, group_size: int
) -> int:
    """One averaging step: every peer of ``vectors`` (the live ones) proposes from its view,
    confirmed groups average. Returns how many peers averaged alone."""
    proposals: dict[str, tuple[str, ...]] = {}
    drawn: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for peer in vectors:
        view = tuple(sorted({*views[peer], peer}))
        if view not in drawn:
            drawn[view] = draw_step_groups(view, key=key, group_size=group_size)
        proposals[peer] = next(stripe for stripe in drawn[view] if peer in stripe)
    done: set[str] = set()
    alone = 0
    new = dict(vectors)
    for peer, proposal in proposals.items():
        answers = {p: proposals.get(p) for p in proposal if p != peer}
        group = confirmed_group(peer, proposal, answers)
        if len(group) == 1:
            alone += 1
        if peer in done:
            continue
        mean = np.mean([vectors[p] for p in group], axis=0)
        for p in group:
            new[p] = mean
        done.update(group)
    vectors.update(new)
    return alone


def consensus_rounds(
    peers: Sequence[str], *, dim: int, group_size: int, seed: int, target: float = 0.01, max_rounds: int = 200
) -> int | None:
    """Rounds of pure gossip averaging (identical views, no training) until the spread is at
    most ``target`` of its start; None if ``max_rounds`` do not get there."""
    rng = np.random.default_rng(seed)
    vectors = {p: rng.standard_normal(dim) for p in peers}
    views = {p: peers for p in peers}
    start = spread(vectors)
    for round_ in range(1, max_rounds + 1):
        gossip_round(vectors, views, key=f"round/{round_}", group_size=group_size)
        if spread(vectors) <= target * start:
            return round_
    return None
