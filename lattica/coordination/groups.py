"""Coordinator-free groups: who averages with whom at one outer step, without I/O.

Theory of operation
-------------------
For a sync key (``"round/12"``) every peer orders the live members it knows by
``sha256(key, peer id)`` — a random permutation of the members that depends on the key alone,
so every peer holding the same member list draws the same one — and cuts it into consecutive
stripes of ``group_size``; a single leftover joins the last stripe (nobody is grouped with only
itself). A peer's *proposal* is its own stripe. Groups are redrawn at every key, so information
mixes across the swarm (the random-permutation scheme of NoLoCo's authors).

Confirmation is pairwise: this peer sends its proposal to each member of it and gets that
member's proposal back (``GroupHandshakes`` answers for us). A partner is *confirmed* when each
of the two holds the other in its proposal — a symmetric test, so both sides reach the same
verdict about their pair. The group a peer uses is itself plus its confirmed partners.

When views differ (a join or a death not yet seen by everyone) two peers may draw different
stripes: only the pairs that agree average together; a peer left without any averages alone and
keeps training. A partner that does not answer within the grace, or answers that the key is
*gone* for it (it finished that step, or moved to a later one), is left out the same way. Since
pairs, not whole groups, are confirmed, members of one stripe may hold different groups while
views differ; strategies on these groups average by pairwise ``exchange``, never by an
all-reduce that needs one agreed list. Nothing waits for a peer outside the proposal, and no
peer decides for others.

Ordering by a per-peer hash keeps a view difference local: a missing peer shifts only the
stripes after its position in the order, not the whole permutation.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lattica.errors import RemoteProtocolError

DEFAULT_GROUP_SIZE = 2
MAX_KEY_LEN = 200
MAX_GROUP_LEN = 64
MAX_PEER_ID_LEN = 128
_STEP = re.compile(r"^round/(\d+)(?:/.*)?$")


@dataclass(frozen=True, kw_only=True)
class GossipGroupsConfig:
    """``group_size``: members per group (2: pairwise gossip). ``grace_s``: how long a partner
    has to answer the handshake, and how long after asking for a key this peer still counts its
    group as open (partners may exchange with it that long). ``remembered_keys``: keys kept."""

    group_size: int = DEFAULT_GROUP_SIZE
    grace_s: float = 5.0
    remembered_keys: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or not 2 <= self.group_size <= MAX_GROUP_LEN // 2:
            raise ValueError(f"group_size must be an integer in [2, {MAX_GROUP_LEN // 2}], got {self.group_size!r}")
        if not self.grace_s > 0:
            raise ValueError(f"grace_s must be positive, got {self.grace_s!r}")
        if self.remembered_keys < 1:
            raise ValueError(f"remembered_keys must be >= 1, got {self.remembered_keys!r}")


def step_of(key: str) -> int | None:
    """The outer step a key belongs to (``round/N`` and keys below it), else None."""
    match = _STEP.match(key)
    return None if match is None else int(match.group(1))


def step_order(members: Iterable[str], *, key: str) -> list[str]:
    """The members (duplicates dropped) in the key's random order."""
    unique = set(members)
    return sorted(unique, key=lambda peer: (hashlib.sha256(f"{key}\0{peer}".encode()).digest(), peer))


def draw_step_groups(members: Iterable[str], *, key: str, group_size: int) -> list[tuple[str, ...]]:
    """Consecutive stripes of the key's order, each sorted; a single leftover joins the last."""
    order = step_order(members, key=key)
    stripes = [order[i : i + group_size] for i in range(0, len(order), group_size)]
    if len(stripes) > 1 and len(stripes[-1]) == 1:
        leftover = stripes.pop()
        stripes[-1] += leftover
    return [tuple(sorted(stripe)) for stripe in stripes]


def proposed_group(view: Iterable[str], me: str, *, key: str, group_size: int) -> tuple[str, ...]:
    """This peer's stripe for ``key`` drawn from its view of the members (itself included).

    Idempotent on a group: drawing again from a proposal (at most ``group_size + 1`` members)
    returns it unchanged, so a strategy may draw its stripe from whatever list a provider gave.
    """
    for stripe in draw_step_groups({*view, me}, key=key, group_size=group_size):
        if me in stripe:
            return stripe
    raise AssertionError("unreachable: every member is in a stripe")


def confirmed_group(
    me: str, proposal: Sequence[str], answers: Mapping[str, Sequence[str] | None]
) -> tuple[str, ...]:
    """``me`` and each partner of ``proposal`` whose own proposal (its answer) holds ``me``.

    ``answers[p]`` is ``None`` (or absent) when ``p`` did not answer in time or its group for
    the key is gone."""
    confirmed = {me}
    for partner in proposal:
        answer = answers.get(partner)
        if partner != me and answer is not None and me in answer:
            confirmed.add(partner)
    return tuple(sorted(confirmed))


# -- the handshake's messages ------------------------------------------------------------------


def handshake_request(run_id: str, key: str, proposal: Sequence[str]) -> dict[str, Any]:
    return {"run": run_id, "key": key, "group": list(proposal)}


def parse_request(message: object, *, run_id: str, peer_id: str) -> tuple[str, tuple[str, ...]]:
    """``(key, proposal)`` of a handshake request; ``RemoteProtocolError`` when malformed, for
    another run, or when the asker is not in its own proposal."""
    if not isinstance(message, dict) or message.get("run") != run_id:
        raise RemoteProtocolError("malformed group request", peer_id=peer_id)
    key = message.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise RemoteProtocolError("malformed group request key", peer_id=peer_id)
    group = _peer_list(message.get("group"), peer_id=peer_id)
    if peer_id not in group:
        raise RemoteProtocolError("group request without its sender", peer_id=peer_id)
    return key, group


def parse_reply(message: object, *, peer_id: str) -> tuple[str, ...] | None:
    """The partner's proposal, or ``None`` when its group for the key is gone."""
    if isinstance(message, dict) and message.get("gone") is True:
        return None
    if not isinstance(message, dict):
        raise RemoteProtocolError("malformed group reply", peer_id=peer_id)
    return _peer_list(message.get("group"), peer_id=peer_id)


def _peer_list(value: object, *, peer_id: str) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_GROUP_LEN
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_LEN for p in value)
    ):
        raise RemoteProtocolError("malformed group list", peer_id=peer_id)
    return tuple(value)


# -- what this peer answers ----------------------------------------------------------------------


class GroupHandshakes:
    """The answering side, as state: which keys this peer opened and when.

    A request for a key is answered with this peer's proposal — computed from its own view, at
    once, whether or not it reached that step (a partner that is a little ahead then waits for
    it in the exchange, up to the grace) — except when the key is *gone*: this peer opened it
    more than ``grace_s`` ago (it has averaged and moved on), or it already opened a later step.
    """

    def __init__(self, config: GossipGroupsConfig) -> None:
        self.config = config
        self._opened: OrderedDict[str, float] = OrderedDict()
        self._latest_step: int | None = None

    def open(self, key: str, now: float) -> None:
        """This peer asks for ``key`` now (its step reached the sync)."""
        self._opened.setdefault(key, now)
        while len(self._opened) > self.config.remembered_keys:
            self._opened.popitem(last=False)
        step = step_of(key)
        if step is not None and (self._latest_step is None or step > self._latest_step):
            self._latest_step = step

    def gone(self, key: str, now: float) -> bool:
        opened = self._opened.get(key)
        if opened is not None and now - opened > self.config.grace_s:
            return True
        step = step_of(key)
        return step is not None and self._latest_step is not None and step < self._latest_step

    def answer(self, key: str, proposal: Sequence[str], now: float) -> dict[str, Any]:
        if self.gone(key, now):
            return {"gone": True}
        return {"group": list(proposal)}
