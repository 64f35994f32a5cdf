"""SparseLoCo: sparse, 2-bit outer updates with error feedback (Sarfi et al., 2025, arXiv 2508.15706).

Theory of operation
-------------------
Every replica holds the shared outer weights θ (fp32, CPU), identical on all members, and its
own error-feedback accumulator e (fp32, one flat vector over all parameters), which plays the
role of DiLoCo's outer momentum. After every ``inner_steps`` (H) inner steps:

1. Δ = θ − θ_local (flattened in ``model.parameters()`` order); candidate c = β·e + Δ;
2. from every chunk of ``chunk`` (4096) elements of c the k = density · chunk entries of largest
   magnitude are kept and their values quantized to 2 bits with a per-chunk scale
   (``lattica.numerics.sparse``): ŝ = what every receiver will decode;
3. each member sends its encoded ŝ to every other member of the round (``sparse_gather``) —
   header, bf16 scales, 2-bit values and indices in the scheme that is smallest for these
   entries (measured: Golomb–Rice gaps at 1–3 %, Elias–Fano if ever smaller), all counted in
   the traffic meter;
4. mean = (1/M) Σ ŝ_m, summed in fp32 in group order; θ ← θ − α·mean; e ← c − ŝ; θ_local ← θ.

No outer momentum: the decayed accumulator carries what was not sent yet.

Invariants: all members of a completed round apply the same mean to the same θ with the same
CPU fp32 arithmetic, so θ stays bit-identical; e only ever loses what was applied. Before the
mean, the gathered ŝ are screened alike at every member (``sparse_gather.screen_gathered``: with
three members or more, one whose norm is above ``max_norm_ratio`` × the median is left out);
with gossip, a partner's ŝ is judged against this replica's own (``numerics.partner_screen``).

Failure rule (e stays consistent): a sync is a transaction. c and ŝ are computed aside; only
when every contribution of the round has arrived are θ and e updated together. If the gather
fails, it is retried with a fresh group (the same ŝ); if every attempt fails the round is
skipped: θ and e keep their values from before the round, θ_local keeps training, and the next
round's Δ covers both periods — nothing is subtracted from e that was not applied. Bytes that
went out on failed attempts are counted as traffic (they were sent). A replica that loads an
outer state (a joiner, a restart, a repair after a split round) starts with e = 0: e is this
replica's private backlog of unsent progress, not part of the shared state; a joiner has sent
nothing and owes nothing, and an adopter's backlog may already be inside the state it adopted,
so dropping it can lose a little of one replica's progress but never applies anything twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lattica.config import DEFAULT_INNER_STEPS, Averaging, check_averaging
from lattica.coordination.groups import proposed_group
from lattica.errors import RemoteProtocolError
from lattica.numerics import sparse
from lattica.numerics.screen import Rejection
from lattica.train.engine.checkpoint import StateDict
from lattica.train.engine.collective import Collective
from lattica.train.engine.outer_placement import copy_into
from lattica.train.strategies.accounting import AccountedStrategy, tensor_bytes
from lattica.train.strategies.base import EveryHSteps, GroupProvider, OuterStepReport
from lattica.train.strategies.gossip import (
    exchange_with_partners,
    left_out_detail,
    realigned_round,
)
from lattica.train.strategies.outer_math import check_tensors, outer_copy, pseudo_gradient
from lattica.train.strategies.sparse_gather import gather_with_retries, screen_gathered


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = 2.75  # α: tuned with the density (docs/strategies.md, SparseLoCo)
    error_decay: float = 0.95  # β
    chunk: int = 4096
    density: float = 0.0159  # k = 65 of every 4096
    value_codec: str = "2bit"
    max_attempts: int = 3
    averaging: Averaging = "allreduce"  # or "gossip": average the sparse ŝ inside small groups
    group_size: int = 2  # gossip: members per group
    exchange_timeout_s: float = 5.0  # gossip: the grace a partner has (the run setting group_grace_s)

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"SparseLoCoConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            raise ValueError(f"SparseLoCoConfig.outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.error_decay <= 1.0:
            raise ValueError(f"SparseLoCoConfig.error_decay must be in [0, 1], got {self.error_decay}")
        if not 1 <= self.chunk <= 1 << 24:
            raise ValueError(f"SparseLoCoConfig.chunk must be in [1, 2**24], got {self.chunk}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"SparseLoCoConfig.density must be in (0, 1], got {self.density}")
        if self.value_codec not in sparse.VALUE_CODECS:
            raise ValueError(f"SparseLoCoConfig.value_codec must be one of {sparse.VALUE_CODECS}")
        if self.max_attempts < 1:
            raise ValueError(f"SparseLoCoConfig.max_attempts must be >= 1, got {self.max_attempts}")
        check_averaging(self.averaging, self.group_size, where="SparseLoCoConfig.")
        if not self.exchange_timeout_s > 0:
            raise ValueError(f"SparseLoCoConfig.exchange_timeout_s must be > 0, got {self.exchange_timeout_s}")

    @property
    def k(self) -> int:
        return max(1, min(self.chunk, round(self.density * self.chunk)))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def compress_with_feedback(
    error: torch.Tensor, delta: torch.Tensor, *, decay: float, chunk: int, k: int, value_codec: str
) -> tuple[sparse.SparseChunks, torch.Tensor]:
    """(ŝ, e'): c = β·e + Δ; ŝ = the quantized top-k of every chunk of c; e' = c − ŝ.

    Pure: ``error`` is not modified. ŝ's values are what every receiver decodes, so
    ``e' + densify(ŝ) == c`` up to one fp32 rounding per sent entry.
    """
    candidate = error * decay + delta
    sent = sparse.quantized(sparse.top_k_per_chunk(candidate, chunk=chunk, k=k), value_codec)
    return sent, candidate - sparse.densify(sent, candidate.numel())


def mean_of_sparse(contributions: Sequence[sparse.SparseChunks], numel: int) -> torch.Tensor:
    """(1/M) Σ densify(ŝ_m), summed in fp32 in the given order (the same bits everywhere)."""
    first = contributions[0]
    total = torch.zeros(first.chunks * first.chunk, dtype=torch.float32)
    for contribution in contributions:
        sparse.add_into(total, contribution)
    total /= len(contributions)
    return total[:numel]


def _values(contribution: sparse.SparseChunks) -> torch.Tensor:
    """The decoded values of a contribution (their norm is that of its dense vector: the
    indices within a chunk are distinct)."""
    return contribution.values.reshape(-1)


class SparseLoCo(EveryHSteps[SparseLoCoConfig], AccountedStrategy[SparseLoCoConfig]):
    """Every H steps: gather every member's sparse 2-bit ŝ, θ ← θ − α·mean; no outer momentum."""

    replicas_agree = True
    name = "sparseloco"
    config_class = SparseLoCoConfig

    @classmethod
    def averages_in_groups(cls, config: object | None) -> bool:
        return isinstance(config, SparseLoCoConfig) and config.averaging == "gossip"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        collective: Collective,
        groups: GroupProvider,
        config: SparseLoCoConfig | None = None,
    ) -> None:
        super().__init__(model, collective=collective, groups=groups, config=config)
        self._names, self._inner, self._outer = outer_copy(model)
        self._numel = sum(p.numel() for p in self._outer)
        self.error = torch.zeros(self._numel, dtype=torch.float32)
        self._chunks = sparse.chunk_count(self._numel, self.config.chunk)
        self._round = 0
        self._completed = 0
        self._step = 0
        # gossip: each replica applies its own group's mean, so replicas differ by design
        self.replicas_agree = self.config.averaging == "allreduce"

    @property
    def completed_rounds(self) -> int:
        return self._completed

    @property
    def outer_state_bytes(self) -> int:
        return tensor_bytes(self._outer) + tensor_bytes([self.error])

    def outer_parameters(self) -> list[torch.Tensor]:
        return self._outer

    @property
    def sync_interval(self) -> int:
        return self.config.inner_steps

    async def sync_at(self, step: int) -> OuterStepReport:
        self._step = step
        return await self.sync()

    async def sync(self) -> OuterStepReport:
        """One outer round now: compress, gather, apply — or leave θ and e as they were."""
        cfg = self.config
        if cfg.averaging == "gossip":  # well behind the swarm: jump the key to the swarm's next step
            self._round = realigned_round(self.groups, self._round)
        key, started = f"round/{self._round}", time.monotonic()
        self._round += 1
        delta = flatten(pseudo_gradient(self._outer, self._inner))
        sent, new_error = compress_with_feedback(
            self.error, delta, decay=cfg.error_decay, chunk=cfg.chunk, k=cfg.k,
            value_codec=cfg.value_codec,
        )
        payload = [sparse.encode(sent, value_codec=cfg.value_codec, scheme=sparse.smallest_scheme_for(sent))]
        if cfg.averaging == "gossip":
            return await self._gossip(key, payload, sent, new_error, started)
        outcome = await gather_with_retries(
            self.collective, self.groups, payload, key=key, tag=f"sparseloco/{key}",
            attempts=cfg.max_attempts, decode=self._decode, own=sent, on_refused=self.partner_screen.refuse,
        )
        self.traffic.record_sync(outcome.bytes_sent)
        if outcome.gathered is None:
            return self._report(key, (), outcome.bytes_sent, started, skipped=True, detail=outcome.failure)
        accepted = screen_gathered(
            outcome.gathered, outcome.group, _values, self.partner_screen, me=self.collective.peer_id,
        )
        if not accepted:
            return self._report(key, (), outcome.bytes_sent, started, skipped=True, detail="no contribution accepted")
        self._apply(mean_of_sparse(accepted, self._numel), new_error)
        return self._report(key, outcome.group, outcome.bytes_sent, started)

    async def _gossip(
        self, key: str, payload: list[torch.Tensor], sent: sparse.SparseChunks, new_error: torch.Tensor,
        started: float,
    ) -> OuterStepReport:
        """Exchange ŝ with the partners of this round's group (each under the grace), average
        over this replica and the partners whose payload arrived intact, apply. Alone (nobody
        answered) the replica applies its own ŝ: it was applied, so e ← c − ŝ holds either way."""
        me = self.collective.peer_id
        members = await self.groups.group_for(key)
        partners = [p for p in proposed_group(members, me, key=key, group_size=self.config.group_size) if p != me]
        answers, silent = await exchange_with_partners(
            self.collective, partners, payload, tag=f"sparseloco/gossip/{key}", codec="raw",
            timeout_s=self.config.exchange_timeout_s, shapes_vary=True,  # Rice/Elias-Fano coded: lengths differ
        )
        answered = [p for p in partners if p not in silent]
        decoded: dict[str, sparse.SparseChunks] = {}
        for partner, answer in zip(answered, answers, strict=True):
            try:
                decoded[partner] = self._decode(answer, partner)
            except RemoteProtocolError as exc:  # a malformed payload: that partner is refused
                self.partner_screen.refuse(Rejection(partner, f"malformed payload: {exc}"))
        verdict = self.partner_screen.screen(
            {"update": [sent.values]}, {p: {"update": [c.values]} for p, c in decoded.items()}
        )
        contributions = {me: sent, **{p: decoded[p] for p in verdict.accepted}}
        group = tuple(sorted(contributions))
        nbytes = sum(t.numel() * t.element_size() for t in payload) * len(partners)
        self.traffic.record_sync(nbytes)
        self._apply(mean_of_sparse([contributions[p] for p in group], self._numel), new_error)
        return self._report(
            key, group, nbytes, started, detail=left_out_detail(silent, set(answered) - set(verdict.accepted)),
        )

    def _decode(self, tensors: list[torch.Tensor], peer: str) -> sparse.SparseChunks:
        if len(tensors) != 1:
            raise RemoteProtocolError(
                f"expected one sparse payload, got {len(tensors)} tensors", peer_id=peer
            )
        return sparse.decode(
            tensors[0], chunk=self.config.chunk, k=self.config.k, chunks=self._chunks, peer_id=peer
        )

    def _report(
        self, key: str, group: tuple[str, ...], nbytes: int, started: float, *, skipped: bool = False,
        detail: str = "",
    ) -> OuterStepReport:
        return OuterStepReport(
            round=self._round - 1, key=key, group=group, bytes_sent=nbytes,
            seconds=time.monotonic() - started, skipped=skipped, detail=detail,
        )

    def _apply(self, mean: torch.Tensor, new_error: torch.Tensor) -> None:
        """θ ← θ − α·mean; e ← e'; θ_local ← θ (the commit of a completed round)."""
        with torch.no_grad():
            offset = 0
            for outer in self._outer:
                n = outer.numel()
                outer.add_(mean[offset : offset + n].view(outer.shape), alpha=-self.config.outer_lr)
                offset += n
            self.error = new_error
            self._copy_outer_to_model()
        self._completed += 1

    def _copy_outer_to_model(self) -> None:
        copy_into(self._inner, self._outer)

    def outer_state_dict(self) -> StateDict:
        """The shared state only: θ and the round counters (e is private, see the module doc)."""
        return {
            "round": self._round,
            "step": self._step,
            "completed_rounds": self._completed,
            "params": {n: p.clone() for n, p in zip(self._names, self._outer, strict=True)},
        }

    def load_outer_state_dict(self, state: StateDict) -> None:
        params = state["params"]
        check_tensors("params", params, self._names, self._outer, require_all=True)
        with torch.no_grad():
            for name, outer in zip(self._names, self._outer, strict=True):
                outer.copy_(params[name])
        self.error = torch.zeros(self._numel, dtype=torch.float32)
        self._round = int(state["round"])
        self._completed = int(state.get("completed_rounds", self._round))
        self._step = int(state.get("step", self._round * self.config.inner_steps))
        self._copy_outer_to_model()
