"""Gossip averaging: averaging inside a small group that changes every outer step.

Theory of operation
-------------------
With ``averaging = "gossip"`` a strategy asks its ``GroupProvider`` for the step's key, draws its
stripe of the answer (``coordination.groups.proposed_group``: the stripe itself when the
provider is ``GossipGroups``, this peer's stripe of the whole list when it is a fixed list),
and ``exchange``s its tensors with each partner of the stripe — concurrently, each under a
deadline. It then averages over itself and the partners that answered; a partner that is gone
or silent is left out, and with nobody left the peer steps on its own. No all-reduce: members
of one stripe may hold slightly different groups while views differ, and pairwise exchanges
need no agreed list.

A replica that fell behind (it was frozen, cut off, or is slow) would otherwise draw one group
after another for steps its partners have left, and average alone each time. Before each sync
it asks the provider where the swarm is (``realigned_round``: ``GossipGroups.next_step``, from
the steps partners announced) and, when its own next key is below a round the swarm has already
reached by ``JUMP_BEHIND`` rounds or more, jumps its key to the swarm's next round, so it meets
partners again there (a round or two apart is the normal spread, not a reason to jump): it lands at
most one step period early, and a partner's request is held for about one of the asker's
periods (``coordination.groups``), so the pair is confirmed when the partner arrives. A replica in
step (its key within two rounds of the swarm's highest) never jumps. Only the key moves: its
weights and momentum stay.

Replicas then differ. Their spread is measured where it costs nothing: at each exchange, before
averaging, from the tensors exchanged anyway —

    consensus distance = ‖φ_i − mean_G(φ)‖ / ‖mean_G(φ)‖   (over all tensors, fp32)

— this peer's distance to its group's mean, relative to the weights' norm. Groups are random
each step, so over steps it samples the swarm's spread; it is 0 while a peer averages alone
(nothing to compare with; the last measured value is kept).

What a partner sent is screened before it is averaged (``screen_answers``,
``numerics.partner_screen``): a contribution with a non-finite value, or with a segment (φ, Δ)
whose norm is far above this replica's own, is refused — left out of the mean as if that
partner had not answered, and reported so the node scores it down and avoids it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import trio

from lattica.coordination.groups import JUMP_BEHIND
from lattica.coordination.provider import SwarmStepSource
from lattica.errors import BrokenError, PeerUnavailableError, RemoteProtocolError
from lattica.numerics.partner_screen import PartnerScreen, Segments
from lattica.train.engine.collective import Collective

# A replica jumps only when its next key is ``JUMP_BEHIND`` (3) rounds or more below the highest round the
# swarm reached. Peers a step apart are the normal spread (the fastest pair opens round t + 1
# while a slower one still opens t); a replica that jumped lands one past the highest, so with
# a threshold of one or two the normal laggards then count as behind it and jump past it in turn,
# and the swarm's keys run away from each other (seen in swarm_scale: keys 4 apart after 7 steps,
# most peer-steps alone).
_EXCHANGE_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)


async def exchange_with_partners(
    collective: Collective,
    partners: Sequence[str],
    tensors: list[torch.Tensor],
    *,
    tag: str,
    codec: str,
    timeout_s: float,
    expect: Callable[[str], Sequence[torch.Size]] | None = None,
    shapes_vary: bool = False,
) -> tuple[list[list[torch.Tensor]], set[str]]:
    """Exchange ``tensors`` with every partner concurrently, each under ``timeout_s``; return
    the answers (in ``partners`` order, shapes checked) and the partners that failed.
    ``expect(partner)``: the shapes that partner sends (default: those of ``tensors``).
    ``shapes_vary``: the answers are encoded payloads whose length differs between peers (a
    sparse payload's index coding): only the tensor count is checked here, the caller decodes
    and validates them."""
    answers: dict[str, list[torch.Tensor]] = {}

    async def one(partner: str) -> None:
        with trio.move_on_after(timeout_s):
            try:
                answer = await collective.exchange(tensors, peer=partner, tag=tag, codec=codec)
            except _EXCHANGE_ERRORS:
                return
            if shapes_vary:
                if len(answer) == len(tensors):
                    answers[partner] = answer
                return
            shapes = [t.shape for t in tensors] if expect is None else list(expect(partner))
            if len(answer) == len(shapes) and all(a.shape == s for a, s in zip(answer, shapes, strict=True)):
                answers[partner] = answer

    async with trio.open_nursery() as nursery:
        for partner in partners:
            nursery.start_soon(one, partner)
    return [answers[p] for p in partners if p in answers], set(partners) - set(answers)


def realigned_round(groups: object, next_round: int) -> int:
    """The round key to use instead of ``next_round``: the swarm's next round when this replica
    is behind it — ``next_round`` at least ``JUMP_BEHIND`` rounds below the highest round the
    swarm has reached (vouched steps, ``GossipGroups.next_step`` − 1) — else ``next_round``
    itself. A replica in step with the swarm (its key within two rounds of the highest) never
    moves. A provider that does not know the swarm's step (a fixed list, the round coordinator)
    leaves it as it is."""
    if not isinstance(groups, SwarmStepSource):
        return next_round
    ahead = groups.next_step()
    if not isinstance(ahead, int) or next_round > ahead - 1 - JUMP_BEHIND:
        return next_round
    return ahead


def screen_answers(
    screen: PartnerScreen, own: Sequence[torch.Tensor], answered: Sequence[str],
    answers: Sequence[Sequence[torch.Tensor]], segments: Callable[[Sequence[torch.Tensor]], Segments],
) -> tuple[list[str], list[Sequence[torch.Tensor]]]:
    """The partners of ``answered`` whose answers ``screen`` accepts, and those answers (both in
    order), each judged segment by segment (``segments``) against this replica's ``own``
    (``numerics.partner_screen``); the refused ones are reported by the screen."""
    verdict = screen.screen(segments(own), {p: segments(a) for p, a in zip(answered, answers, strict=True)})
    kept = set(verdict.accepted)
    pairs = [(p, a) for p, a in zip(answered, answers, strict=True) if p in kept]
    return [p for p, _ in pairs], [a for _, a in pairs]


def left_out_detail(missing: Iterable[str], refused: Iterable[str]) -> str:
    """The partners an exchange left out, for a sync's report: silent or gone, and refused."""
    silent, screened_out = sorted(missing), sorted(refused)
    parts = [f"no answer from: {', '.join(silent)}"] if silent else []
    if screened_out:
        parts.append(f"refused: {', '.join(screened_out)}")
    return "; ".join(parts)


def phi_and_delta(payload: Sequence[torch.Tensor]) -> Segments:
    """``[φ..., Δ...]`` (DiLoCo's and NoLoCo's gossip payload) as its two segments."""
    n = len(payload) // 2
    return {"phi": payload[:n], "delta": payload[n:]}


def group_mean(contributions: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Element-wise mean of several tensor lists, summed in fp32, in the first list's dtype."""
    total = [t.detach().to(torch.float32).clone() for t in contributions[0]]
    for other in contributions[1:]:
        for acc, t in zip(total, other, strict=True):
            acc += t.detach().to(torch.float32)
    count = len(contributions)
    return [(acc / count).to(ref.dtype) for acc, ref in zip(total, contributions[0], strict=True)]


def consensus_distance(own: Sequence[torch.Tensor], mean: Sequence[torch.Tensor]) -> float:
    """‖own − mean‖ / ‖mean‖ over all tensors (0 when the mean is all zeros)."""
    diff = 0.0
    norm = 0.0
    for o, m in zip(own, mean, strict=True):
        m32 = m.detach().to(torch.float32)
        diff += float((o.detach().to(torch.float32) - m32).pow(2).sum())
        norm += float(m32.pow(2).sum())
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else 0.0
