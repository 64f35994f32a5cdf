"""NoLoCo: outer steps without any all-reduce (Kolehmainen et al., 2025, Gensyn).

Theory of operation
-------------------
Every H inner steps (one round) each worker asks the ``GroupProvider`` for the round's members.
From the round number and the *sorted* member list every worker derives the same seed, draws the
same permutation, and cuts it into consecutive stripes of ``group_size`` (a lone leftover joins
the previous stripe, so nobody is grouped with only themselves). A worker then ``exchange``s
``[φ_i, Δ_i]`` with each other member of its stripe — concurrently, each under its own deadline —
and applies the modified Nesterov step of the paper with the group means:

    δ_i ← μ·δ_i − η·mean_G(Δ) − γ·(φ_i − mean_G(φ));   φ_i ← φ_i + δ_i;   θ_i ← φ_i

Failure: a partner that is gone (``PeerUnavailableError``) or silent past the deadline is left
out of the means; with nobody left the worker steps on its own Δ (n = 1, the γ term vanishes).
So is a partner whose ``[φ, Δ]`` the screen refuses (``gossip.screen_answers``: non-finite values,
a norm far above this worker's own).
No one waits on anyone outside their stripe, so a dead peer stalls at most its partners, and
those only until the deadline. A worker that fell behind the swarm (frozen, slow) jumps its
round keys to the swarm's next step (``gossip.realigned_round``) and pairs again there. Replicas are
not identical: φ differs between workers.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lattica.config import DEFAULT_INNER_STEPS
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.outer_placement import copy_into
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import EveryHSteps, GroupProvider, OuterStepReport
from lattica.train.strategies.gossip import (
    consensus_distance,
    exchange_with_partners,
    group_mean,
    left_out_detail,
    phi_and_delta,
    realigned_round,
    screen_answers,
)
from lattica.train.strategies.outer_math import outer_copy, pseudo_gradient
from lattica.train.strategies.traffic import payload_bytes


@dataclass(frozen=True, kw_only=True)
class NoLoCoConfig:
    """Author defaults: n = 2, H = 50, η = γ = 0.7, μ = 0.5."""

    inner_steps: int = DEFAULT_INNER_STEPS
    group_size: int = 2
    outer_lr: float = 0.7
    gamma: float = 0.7
    momentum: float = 0.5
    exchange_timeout_s: float = 5.0  # the grace a partner has (the run setting group_grace_s)
    codec: str = "fp32"

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")
        if self.outer_lr <= 0 or self.gamma < 0 or not 0 <= self.momentum < 1:
            raise ValueError("need outer_lr > 0, gamma >= 0 and 0 <= momentum < 1")
        if self.exchange_timeout_s <= 0:
            raise ValueError("exchange_timeout_s must be positive")


def round_seed(round_number: int, members: Sequence[str]) -> int:
    """A seed every member derives identically from the round and the sorted member list."""
    text = f"noloco/{round_number}/" + "\n".join(sorted(members))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def draw_groups(
    members: Sequence[str], *, round_number: int, group_size: int
) -> list[tuple[str, ...]]:
    """Consecutive stripes of a seeded permutation; a single leftover joins the last stripe."""
    order = sorted(members)
    random.Random(round_seed(round_number, order)).shuffle(order)
    groups = [tuple(order[i : i + group_size]) for i in range(0, len(order), group_size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        leftover = groups.pop()
        groups[-1] += leftover
    return groups


@torch.no_grad()
def noloco_outer_step(
    phi: Sequence[torch.Tensor],
    velocity: Sequence[torch.Tensor],
    mean_delta: Sequence[torch.Tensor],
    mean_phi: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    gamma: float,
) -> None:
    """In place: δ ← μδ − η·mean(Δ) − γ(φ − mean(φ)); φ ← φ + δ."""
    for p, v, d, m in zip(phi, velocity, mean_delta, mean_phi, strict=True):
        v.mul_(momentum).sub_(d, alpha=lr).sub_(p - m, alpha=gamma)
        p.add_(v)


class NoLoCo(EveryHSteps[NoLoCoConfig], AccountedStrategy[NoLoCoConfig]):
    name = "noloco"
    config_class = NoLoCoConfig

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        return True  # small groups from the GroupProvider, never one all-reduce

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: NoLoCoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        # φ on the host (pinned for a model on CUDA): what the exchanges send, and the outer math
        self._names, self._params, self._phi = outer_copy(model)
        self._velocity = [torch.zeros(p.shape, dtype=torch.float32) for p in self._params]
        self._rounds = 0
        self._round_offset = 0  # round keys minus step // H, after jumps to the swarm's step

    @property
    def completed_rounds(self) -> int:
        return self._rounds

    @property
    def outer_state_bytes(self) -> int:
        return tensor_bytes(self._phi) + tensor_bytes(self._velocity)

    @property
    def sync_interval(self) -> int:
        return self.config.inner_steps

    async def sync_at(self, step: int) -> OuterStepReport:
        return await self._outer_round(step // self.config.inner_steps)

    async def _outer_round(self, step_round: int) -> OuterStepReport:
        started = time.monotonic()
        # a replica that fell behind the swarm jumps its round keys to the swarm's next step
        # (the offset stays: its steps count on from there); see gossip.realigned_round
        round_number = realigned_round(self.groups, step_round + self._round_offset)
        self._round_offset = round_number - step_round
        key = f"round/{round_number}"
        members = list(await self.groups.group_for(key))
        me = self.collective.peer_id
        stripes = draw_groups(members, round_number=round_number, group_size=self.config.group_size)
        stripe = next(s for s in stripes if me in s)
        with torch.no_grad():
            delta = pseudo_gradient(self._phi, self._params)
        partners = [q for q in stripe if q != me]
        answers, missing = await exchange_with_partners(
            self.collective, partners, self._phi + delta, tag=f"noloco/{key}",
            codec=self.config.codec, timeout_s=self.config.exchange_timeout_s,
        )
        answered = [q for q in partners if q not in missing]
        accepted, kept = screen_answers(self.partner_screen, self._phi + delta, answered, answers, phi_and_delta)
        n = len(self._phi)
        contributions = [self._phi + delta, *kept]
        mean_phi = group_mean([c[:n] for c in contributions])
        mean_delta = group_mean([c[n:] for c in contributions])
        spread = consensus_distance(self._phi, mean_phi) if kept else None
        noloco_outer_step(
            self._phi,
            self._velocity,
            mean_delta,
            mean_phi,
            lr=self.config.outer_lr,
            momentum=self.config.momentum,
            gamma=self.config.gamma,
        )
        copy_into(self._params, self._phi)
        self._rounds += 1
        sent = payload_bytes(self._phi + delta, self.config.codec) * (len(stripe) - 1)
        self.traffic.record_sync(sent)
        return OuterStepReport(
            round=round_number,
            key=key,
            group=tuple(sorted({me, *accepted})),  # sorted, as every provider's
            bytes_sent=sent,
            seconds=time.monotonic() - started,
            skipped=not kept,
            detail=left_out_detail(missing, set(answered) - set(accepted)),
            consensus_distance=spread,
        )

    def outer_state_dict(self) -> StateDict:
        return {
            "params": {n: t.clone() for n, t in zip(self._names, self._phi, strict=True)},
            "velocity": {n: t.clone() for n, t in zip(self._names, self._velocity, strict=True)},
            "rounds": self._rounds,
            "round_offset": self._round_offset,
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        with torch.no_grad():
            for name, phi, velocity in zip(self._names, self._phi, self._velocity, strict=True):
                phi.copy_(state["params"][name])
                velocity.copy_(state["velocity"][name])
        copy_into(self._params, self._phi)
        self._rounds = int(state["rounds"])
        self._round_offset = int(state.get("round_offset", 0))
