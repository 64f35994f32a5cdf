"""SPES: SParse Expert Synchronization for mixture-of-experts training (arXiv 2602.11543).

Theory of operation
-------------------
Each node owns a subset of the experts (expert e of every MoE layer forms one unit; the map
comes from an ``ExpertOwnership`` source, see ``experts.py``). Experts it does not own are
frozen (``requires_grad`` False) and hold no optimizer state, but tokens are still routed to
them. Every node trains all dense parameters (embeddings, attention, norms, routers, head).

Every S inner steps (one sync, key ``round/r``):

1. dense parameters: plain mean over the members (one ``allreduce``), FedAvg style;
2. experts: each expert is copied from its single *source* — its owner, or, if the owner has
   left, a holder of the latest copy (the lowest member id; every member holds the copy of the
   last sync). The copy is an all-gather over ``exchange``: each pair of members swaps the
   experts each one is the source of, so every byte sent is an expert's weights, exactly,
   and a node sends (M − 1) × the experts it owns (an all-reduce of each expert against zeros
   would send 2 (M − 1)/M × *all* experts from every node, and lose exactness for M ≠ 2^k);
3. on merge rounds (expert-merging warm-up) every expert moves toward its K most similar
   experts of the same layer (cosine similarity of the first weight matrix):
   θ_e ← θ_e + α_t·mean_{j∈N_e}(θ_j − θ_e), α_t = α_0·max(0, 1 − t/T_decay);
4. the new ownership map takes effect: newly owned experts are unfrozen (and added to the
   attached inner optimizer), newly foreign ones frozen and their optimizer state dropped. A
   newly owned expert was copied from its source in step 2 of this very sync, so its new owner
   trains it from the latest copy. The first sync takes its map from its agreed members.

Gossip (``averaging = "gossip"``, ``group_size``, ``exchange_timeout_s``): instead of the
all-reduce over every member, each node exchanges with its small group for the round (the
``GroupProvider``'s answer, its stripe drawn as in ``gossip.py``) its dense parameters and the
experts it owns, concurrently, each partner under the grace. Dense parameters become the plain
mean over itself and the partners that answered; each expert owned by an answering partner is
copied from it; its own experts, and copies of experts whose owner is not in the group, stay as
they are (a copy is refreshed whenever its owner is drawn into the node's group). The map does
not move with a group — a group is not the membership — : it is the one in force
(``ownership.current()``, the replicated map in the daemon), so experts stay with their owners.
Replicas then differ (``replicas_agree`` False); the spread of the dense parameters is measured
as ``consensus_distance``. A partner that is silent, gone, or answers tensors that do not fit
its experts in the map is left out; alone, a node keeps its weights and trains on. So is a
partner whose answer the screen refuses (``numerics.partner_screen``): a non-finite value
anywhere, or dense weights whose norm is far above this node's own (expert copies are judged
for non-finite values only: the owner is an expert's one source). In an all-reduce sync, expert
copies that are not finite are refused and the copy every member holds is kept.

After a completed all-reduce sync all members hold bit-identical weights. Failure: if any part of the sync
fails (a peer vanished), nothing is applied and the sync is retried with the group agreed for
``round/N/retry/1`` (without the peer that failed it), whose member list reassigns the experts
of a node that left; if the retry fails too, the round is reported skipped. The departed
owner's progress since the last sync is lost; nothing else is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import trio

from lattica.config import DEFAULT_INNER_STEPS, Averaging, check_averaging
from lattica.coordination.groups import proposed_group
from lattica.errors import BrokenError, PeerUnavailableError, RemoteProtocolError
from lattica.numerics.partner_screen import Segments, refusal, segment_norm
from lattica.numerics.screen import Rejection
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.moe import MoEGPT, dense_parameters, expert_parameters
from lattica.train.strategies.accounting import AccountedStrategy
from lattica.train.strategies.base import GroupProvider, OuterStepReport, StrategyHandles
from lattica.train.strategies.experts import (
    DerivedOwnership,
    ExpertOwnership,
    assign_experts,
    experts_of,
)
from lattica.train.strategies.gossip import (
    consensus_distance,
    exchange_with_partners,
    group_mean,
    left_out_detail,
)
from lattica.train.strategies.traffic import allreduce_bytes, payload_bytes

log = logging.getLogger(__name__)

_SYNC_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)


@dataclass(frozen=True, kw_only=True)
class SPESConfig:
    """Defaults follow the authors' cluster script (α_0 = 0.05 every 500 steps), except S: the
    run-wide H (``DEFAULT_INNER_STEPS``; the authors use 100)."""

    sync_every: int = DEFAULT_INNER_STEPS  # S, the H of SPES
    merge_every: int = 500
    merge_alpha: float = 0.05
    merge_decay_steps: int = 20000
    merge_neighbors: int = 4
    codec: str = "fp32"
    members: tuple[str, ...] = field(default=())
    max_attempts: int = 2  # a failed sync is retried once with the group agreed for the retry
    averaging: Averaging = "allreduce"  # or "gossip": dense mean and owners' experts inside small groups
    group_size: int = 2  # gossip: members per group
    exchange_timeout_s: float = 5.0  # gossip: the grace a partner has (the run setting group_grace_s)

    def __post_init__(self) -> None:
        check_averaging(self.averaging, self.group_size, where="SPESConfig.")
        if not self.exchange_timeout_s > 0:
            raise ValueError(f"exchange_timeout_s must be positive, got {self.exchange_timeout_s!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.merge_every < 1 or self.merge_every % self.sync_every:
            raise ValueError("merge_every must be a positive multiple of sync_every")
        if self.merge_alpha < 0 or self.merge_decay_steps < 1 or self.merge_neighbors < 1:
            raise ValueError("need merge_alpha >= 0, merge_decay_steps >= 1, merge_neighbors >= 1")


def merge_alpha_at(step: int, *, alpha: float, decay_steps: int) -> float:
    """α_t = α_0 · max(0, 1 − t / T_decay)."""
    return alpha * max(0.0, 1.0 - step / decay_steps)


@torch.no_grad()
def merge_similar_experts(
    experts: Sequence[Sequence[torch.Tensor]], *, neighbors: int, alpha: float
) -> None:
    """In place, for the experts of one layer (each a list of tensors, first = first weight)."""
    if len(experts) < 2 or alpha == 0.0:
        return
    keys = torch.stack([e[0].flatten().to(torch.float32) for e in experts])
    keys = keys / keys.norm(dim=1, keepdim=True).clamp_min(1e-12)
    similarity = keys @ keys.T
    similarity.fill_diagonal_(float("-inf"))
    nearest = similarity.topk(min(neighbors, len(experts) - 1), dim=1).indices
    before = [[t.clone() for t in e] for e in experts]
    for e, tensors in enumerate(experts):
        for i, t in enumerate(tensors):
            pull = torch.stack([before[j][i] - before[e][i] for j in nearest[e].tolist()])
            t.add_(pull.mean(dim=0), alpha=alpha)


class SPES(AccountedStrategy[SPESConfig]):
    replicas_agree = True
    trains_experts = True

    name = "spes"
    config_class = SPESConfig

    def __init__(
        self,
        model: MoEGPT,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: SPESConfig | None = None,
        ownership: ExpertOwnership | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        self.num_experts = model.moe_config.num_experts
        if ownership is None:
            if not self.config.members:
                raise ValueError("SPES needs an ExpertOwnership source or SPESConfig.members")
            ownership = DerivedOwnership(self.config.members, self.num_experts)
        self.ownership = ownership
        self._experts = expert_parameters(model)
        self._dense = dense_parameters(model)
        self._layers = [
            [list(expert.parameters()) for expert in moe.experts] for moe in model.moe_layers()
        ]
        self.owners: dict[int, str] = dict(ownership.current())
        self._completed = 0
        self._apply_ownership()
        # gossip: replicas differ by design, and their spread is measured
        self.replicas_agree = self.config.averaging == "allreduce"

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        return isinstance(config, SPESConfig) and config.averaging == "gossip"

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: object | None,
        handles: StrategyHandles,
    ) -> SPES:
        """With the node's expert ownership (``handles.ownership``) when it keeps one."""
        if not isinstance(model, MoEGPT):
            raise TypeError(f"SPES trains a mixture-of-experts model (MoEGPT), got {type(model).__name__}")
        typed = cast("SPESConfig | None", config)  # the constructor refuses another kind
        return cls(
            model, collective=collective, groups=groups, config=typed, ownership=handles.ownership,
        ).take_handles(handles)

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def owned_experts(self) -> list[int]:
        return experts_of(self.owners, self.collective.peer_id)

    def attach_inner_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_inner_optimizer(optimizer)
        self._apply_ownership()

    def next_sync_step(self, step: int) -> int:
        return (step // self.config.sync_every + 1) * self.config.sync_every

    async def after_inner_step(self, step: int) -> list[OuterStepReport]:
        if step % self.config.sync_every:
            return []
        return [await self._sync(step, step // self.config.sync_every)]

    async def _sync(self, step: int, round_number: int) -> OuterStepReport:
        if self.config.averaging == "gossip":
            return await self._gossip_sync(step, round_number)
        started, key = time.monotonic(), f"round/{round_number}"
        dense_sent, failure = 0, ""
        for attempt in range(self.config.max_attempts):
            # a retry agrees on a fresh group (without the peer that failed the first attempt)
            attempt_key = key if attempt == 0 else f"{key}/retry/{attempt}"
            members = tuple(await self.groups.group_for(attempt_key))
            if self._completed == 0:
                # the first sync's agreed members fix the initial map (nodes that started with
                # different views of the swarm would otherwise disagree on who sends what)
                self.owners = assign_experts(members, self.num_experts)
                self.ownership.adopt(self.owners)
            sources = {e: o if o in members else min(members) for e, o in self.owners.items()}
            dense_sent += allreduce_bytes(self._dense, len(members), self.config.codec)
            failure = ""
            try:
                dense_mean, copies, expert_sent = await self._exchange(
                    members, sources, attempt_key
                )
            except* _SYNC_ERRORS as group:
                failure = "; ".join(str(e) for e in group.exceptions)
            if not failure:
                break
        if failure:
            self.traffic.record_sync(dense_sent)
            return OuterStepReport(
                round=round_number,
                key=key,
                group=(),
                bytes_sent=dense_sent,
                seconds=time.monotonic() - started,
                skipped=True,
                detail=failure,
            )
        self._apply(dense_mean, copies)
        if self.config.merge_alpha > 0 and step % self.config.merge_every == 0:
            alpha = merge_alpha_at(
                step, alpha=self.config.merge_alpha, decay_steps=self.config.merge_decay_steps
            )
            for layer in self._layers:
                merge_similar_experts(layer, neighbors=self.config.merge_neighbors, alpha=alpha)
        owned_before = set(self.owned_experts)
        self.owners = dict(await self.ownership.for_sync(key, members))
        for e in sorted(set(self.owned_experts) - owned_before):
            # the copy applied above is the latest one: train it from there
            log.info("expert %d now owned here; latest copy from %s", e, sources[e])
        self._apply_ownership()
        self._completed += 1
        self.traffic.record_sync(dense_sent + expert_sent)
        return OuterStepReport(
            round=round_number,
            key=key,
            group=members,
            bytes_sent=dense_sent + expert_sent,
            seconds=time.monotonic() - started,
            detail=f"experts owned: {self.owned_experts}",
        )

    async def _gossip_sync(self, step: int, round_number: int) -> OuterStepReport:
        """Dense mean and the owners' experts inside this round's small group."""
        started, key = time.monotonic(), f"round/{round_number}"
        me = self.collective.peer_id
        members = await self.groups.group_for(key)
        stripe = proposed_group(members, me, key=key, group_size=self.config.group_size)
        partners = [p for p in stripe if p != me]
        self.owners = dict(self.ownership.current())  # the map in force; a group does not move it
        dense = [p.detach() for p in self._dense]
        payload = dense + [t.detach() for e in experts_of(self.owners, me) for t in self._experts[e]]

        def expect(partner: str) -> list[torch.Size]:
            return [p.shape for p in dense] + [
                t.shape for e in experts_of(self.owners, partner) for t in self._experts[e]
            ]

        answers, missing = await exchange_with_partners(
            self.collective, partners, payload, tag=f"spes/gossip/{key}", codec=self.config.codec,
            timeout_s=self.config.exchange_timeout_s, expect=expect,
        )
        answered = [p for p in partners if p not in missing]
        n = len(dense)
        # experts are judged for non-finite values only: this node's copy of another's expert
        # is a stale snapshot, not its own update, and the owner is the expert's one source
        verdict = self.partner_screen.screen({"dense": dense}, {
            p: self._segments(a, n, experts_of(self.owners, p)) for p, a in zip(answered, answers, strict=True)
        })
        kept = [(p, a) for p, a in zip(answered, answers, strict=True) if p in verdict.accepted]
        answered, answers = [p for p, _ in kept], [a for _, a in kept]
        copies: dict[int, list[torch.Tensor]] = {}
        spread = None
        if answers:
            mean = group_mean([dense, *[a[:n] for a in answers]])
            spread = consensus_distance(dense, mean)
            for partner, answer in zip(answered, answers, strict=True):
                offset = n
                for e in experts_of(self.owners, partner):
                    count = len(self._experts[e])
                    copies[e] = list(answer[offset : offset + count])
                    offset += count
        else:
            mean = [t.clone() for t in dense]
        self._apply(mean, copies)
        if self.config.merge_alpha > 0 and step % self.config.merge_every == 0:
            alpha = merge_alpha_at(
                step, alpha=self.config.merge_alpha, decay_steps=self.config.merge_decay_steps
            )
            for layer in self._layers:
                merge_similar_experts(layer, neighbors=self.config.merge_neighbors, alpha=alpha)
        self._apply_ownership()
        self._completed += 1
        sent = payload_bytes(payload, self.config.codec) * len(partners)
        self.traffic.record_sync(sent)
        return OuterStepReport(
            round=round_number,
            key=key,
            group=tuple(sorted({me, *answered})),
            bytes_sent=sent,
            seconds=time.monotonic() - started,
            detail=left_out_detail(missing, [r.peer for r in verdict.rejected]),
            consensus_distance=spread,
        )

    def _segments(self, payload: Sequence[torch.Tensor], dense: int, experts: Sequence[int]) -> Segments:
        """A payload of the dense parameters (``dense`` tensors) then ``experts``' tensors, by
        segment (``"dense"``, ``"expert/<e>"``) for the partner screen."""
        segments: dict[str, Sequence[torch.Tensor]] = {"dense": payload[:dense]}
        offset = dense
        for e in experts:
            count = len(self._experts[e])
            segments[f"expert/{e}"] = payload[offset : offset + count]
            offset += count
        return segments

    async def _exchange(
        self, members: tuple[str, ...], sources: Mapping[int, str], key: str
    ) -> tuple[list[torch.Tensor], dict[int, list[torch.Tensor]], int]:
        """Dense all-reduce and the expert all-gather, concurrently."""
        me = self.collective.peer_id
        mine = experts_of(sources, me)
        payload = [t.detach() for e in mine for t in self._experts[e]]
        copies: dict[int, list[torch.Tensor]] = {}
        result: list[list[torch.Tensor]] = []

        async def dense() -> None:
            result.append(
                await self.collective.allreduce(
                    [p.detach() for p in self._dense],
                    group=members,
                    tag=f"spes/{key}/dense",
                    codec=self.config.codec,
                )
            )

        async def experts_from(peer: str) -> None:
            answer = await self.collective.exchange(
                payload, peer=peer, tag=f"spes/{key}/experts", codec=self.config.codec
            )
            theirs = experts_of(sources, peer)
            per_expert = [len(self._experts[e]) for e in theirs]
            if len(answer) != sum(per_expert):
                raise RemoteProtocolError("wrong number of expert tensors", peer_id=peer)
            offset, arrived = 0, {}
            for e, count in zip(theirs, per_expert, strict=True):
                arrived[e] = list(answer[offset : offset + count])
                offset += count
                shapes = [t.shape for t in arrived[e]]
                if shapes != [p.shape for p in self._experts[e]]:
                    raise RemoteProtocolError(f"expert {e} arrived with wrong shapes", peer_id=peer)
            if self._copies_refused(peer, arrived) is None:
                copies.update(arrived)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dense)
            for peer in members:
                if peer != me:
                    nursery.start_soon(experts_from, peer)
        sent = payload_bytes(payload, self.config.codec) * (len(members) - 1)
        return result[0], copies, sent

    def _copies_refused(self, peer: str, arrived: Mapping[int, Sequence[torch.Tensor]]) -> Rejection | None:
        """Why the expert copies ``peer`` sent in an all-reduce sync are refused (a non-finite
        value), or None; a refused source's experts keep the copies every member holds, so
        replicas still agree. Each expert has one source, so, as in an all-reduce of two, no
        majority tells an outlier by its norm."""
        why = refusal(peer, {f"expert/{e}": segment_norm(t) for e, t in arrived.items()}, {}, None)
        if why is not None:
            self.partner_screen.refuse(why)
        return why

    @torch.no_grad()
    def _apply(
        self, dense_mean: Sequence[torch.Tensor], copies: Mapping[int, list[torch.Tensor]]
    ) -> None:
        for p, mean in zip(self._dense, dense_mean, strict=True):
            p.copy_(mean)
        for e, tensors in copies.items():
            for p, copy in zip(self._experts[e], tensors, strict=True):
                p.copy_(copy)

    def _apply_ownership(self) -> None:
        """Unfreeze owned experts, freeze the rest and drop their inner optimizer state."""
        owned = set(self.owned_experts)
        optimizer = self.inner_optimizer
        for e, params in self._experts.items():
            for p in params:
                p.requires_grad_(e in owned)
                if e in owned:
                    if optimizer is not None and not _holds(optimizer, p):
                        optimizer.param_groups[0]["params"].append(p)
                else:
                    p.grad = None
                    if optimizer is not None:
                        optimizer.state.pop(p, None)

    def outer_state_dict(self) -> StateDict:
        return {
            "params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "owners": dict(self.owners),
            "completed_rounds": self._completed,
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state["params"][name])
        self.owners = {int(e): str(o) for e, o in state["owners"].items()}
        self._completed = int(state["completed_rounds"])
        self.ownership.adopt(self.owners)
        self._apply_ownership()


def _holds(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(p is param for group in optimizer.param_groups for p in group["params"])
