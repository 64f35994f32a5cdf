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

Readiness (stragglers). A partner is confirmed only once it has *reached* the step itself.
Every request carries the asker's *hold*: two of its step periods (its pace — the moving
average of the intervals between its syncs — or the longest of its last four intervals when
that is longer; at least ``hold_s``, by default half the grace, and at most ``max_hold_s``),
and the asker waits that hold plus the grace for the answer. A request
for a step the answerer has not opened yet is held up to that hold and answered with the
proposal the moment the answerer opens the step, or ``late`` when the hold ends first. It is
answered ``late`` at once when the answerer is a straggler relative to the asker: its own
expected arrival (its last sync plus one pace per step still to go) falls after the hold, i.e.
it is more than two of the asker's periods away. So a hold scales with the swarm's step time: with a long exchange (a
WAN payload) a peer that averaged alone finishes its step much sooner than one that exchanged,
and reaches the next step up to a whole period before its partner; told ``late``, both would
average alone again, finish sooner again and drift further apart (a peer alone runs ahead, so
lone steps breed lone steps). Two periods of the longest recent kind cover a partner still in
a full exchange, while a peer ten times slower than the asker is left out at once. Verdicts agree on
both sides: a peer that answered ``late`` leaves the asker out of its own group for the key
(``decline``), the asker leaves out a partner that answered ``late``, and a peer leaves out
(declines) every partner it did not confirm, so a ready answer that arrives after the asker stopped
waiting is not taken as a pair by the answerer alone. A key stays open (answered ``ready``) for the
hold this peer asked for plus the grace.

Realignment. Every answer carries the answerer's latest opened step, and every request the
step the asker has reached (its key). A peer learns from them where the swarm is
(``SwarmStep``: the highest step of the last peers heard that another of them vouches for,
within two steps, so one peer announcing a far step moves nobody; in a view of at most four
members, where a peer hears about one partner per step, the highest step heard) and a strategy that
fell behind jumps its next key there, instead of drawing one group after another for steps its
partners have left. A jump lands at most one period early; the partners' hold covers that.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lattica.errors import RemoteProtocolError

DEFAULT_GROUP_SIZE = 2
MAX_KEY_LEN = 200
MAX_GROUP_LEN = 64
MAX_PEER_ID_LEN = 128
MAX_REQUEST_HOLD_S = 3600.0  # a requested hold above this is malformed
# a replica whose next key is this many rounds or more below the swarm's jumps there (see
# ``lattica.train.strategies.gossip.realigned_round``); a peer closer behind opens every step
JUMP_BEHIND = 3
HOLD_PERIODS = 2.0  # the hold a peer asks for, in its own step periods (``hold_pace``)
_STEP = re.compile(r"^round/(\d+)(?:/.*)?$")


@dataclass(frozen=True, kw_only=True)
class GossipGroupsConfig:
    """``group_size``: members per group (2: pairwise gossip). ``grace_s``: how long a partner
    has to answer the handshake, and how long after asking for a key this peer still counts its
    group as open beyond its hold (partners may exchange with it that long). ``ready_wait_s``:
    the least hold this peer asks for (default and cap: half the grace; ``hold_s``); the hold
    it asks for is two of its step periods when that is longer (``hold_for``), at most
    ``max_hold_s``, which also caps the hold it grants a partner. ``remembered_keys``: keys kept."""

    group_size: int = DEFAULT_GROUP_SIZE
    grace_s: float = 5.0
    ready_wait_s: float | None = None  # None: half the grace
    max_hold_s: float = 60.0
    remembered_keys: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or not 2 <= self.group_size <= MAX_GROUP_LEN // 2:
            raise ValueError(f"group_size must be an integer in [2, {MAX_GROUP_LEN // 2}], got {self.group_size!r}")
        if not self.grace_s > 0:
            raise ValueError(f"grace_s must be positive, got {self.grace_s!r}")
        if self.ready_wait_s is not None and not self.ready_wait_s >= 0:
            raise ValueError(f"ready_wait_s must be >= 0, got {self.ready_wait_s!r}")
        if not 0 < self.max_hold_s <= MAX_REQUEST_HOLD_S:
            raise ValueError(f"max_hold_s must be in (0, {MAX_REQUEST_HOLD_S:g}], got {self.max_hold_s!r}")
        if self.remembered_keys < 1:
            raise ValueError(f"remembered_keys must be >= 1, got {self.remembered_keys!r}")

    @property
    def hold_s(self) -> float:
        """How long a request for a step not reached yet is held: ``ready_wait_s``, at most
        (and by default) half the grace, so the answer reaches the asker within its grace."""
        half = self.grace_s / 2
        return half if self.ready_wait_s is None else min(self.ready_wait_s, half)

    def hold_for(self, pace: float | None) -> float:
        """The hold a peer whose step period is ``pace`` (None: not known yet) asks its partners
        for: ``HOLD_PERIODS`` periods, at least ``hold_s``, at most ``max_hold_s``."""
        hold = self.hold_s if pace is None else max(self.hold_s, HOLD_PERIODS * pace)
        return min(hold, self.max_hold_s)


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


def handshake_request(
    run_id: str, key: str, proposal: Sequence[str], *, hold_s: float | None = None
) -> dict[str, object]:
    message: dict[str, object] = {"run": run_id, "key": key, "group": list(proposal)}
    if hold_s is not None:
        message["hold"] = float(hold_s)
    return message


@dataclass(frozen=True)
class Request:
    """A partner's request: the key, its proposal, and how long it asks to be held for a step
    not reached yet (``hold_s``; None: the answerer's own ``hold_s``)."""

    key: str
    group: tuple[str, ...]
    hold_s: float | None = None


def parse_request(message: object, *, run_id: str, peer_id: str) -> Request:
    """The handshake request; ``RemoteProtocolError`` when malformed, for another run, or when
    the asker is not in its own proposal."""
    if not isinstance(message, dict) or message.get("run") != run_id:
        raise RemoteProtocolError("malformed group request", peer_id=peer_id)
    key = message.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise RemoteProtocolError("malformed group request key", peer_id=peer_id)
    group = _peer_list(message.get("group"), peer_id=peer_id)
    if peer_id not in group:
        raise RemoteProtocolError("group request without its sender", peer_id=peer_id)
    hold = message.get("hold")
    if hold is not None and (
        not isinstance(hold, int | float) or isinstance(hold, bool) or not math.isfinite(hold)
        or not 0 <= hold <= MAX_REQUEST_HOLD_S
    ):
        raise RemoteProtocolError("malformed group request hold", peer_id=peer_id)
    return Request(key, group, None if hold is None else float(hold))


@dataclass(frozen=True)
class Reply:
    """A partner's answer: its proposal (``group``; None when the key is gone for it or it is
    ``late``) and its latest opened step (``step``; None when it announced none)."""

    group: tuple[str, ...] | None
    step: int | None = None
    late: bool = False


def parse_reply(message: object, *, peer_id: str) -> Reply:
    """The partner's answer; ``RemoteProtocolError`` when malformed."""
    if not isinstance(message, dict):
        raise RemoteProtocolError("malformed group reply", peer_id=peer_id)
    step = message.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**53):
        raise RemoteProtocolError("malformed group reply step", peer_id=peer_id)
    if message.get("gone") is True:
        return Reply(None, step)
    if message.get("late") is True:
        return Reply(None, step, late=True)
    return Reply(_peer_list(message.get("group"), peer_id=peer_id), step)


def _peer_list(value: object, *, peer_id: str) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_GROUP_LEN
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_LEN for p in value)
    ):
        raise RemoteProtocolError("malformed group list", peer_id=peer_id)
    return tuple(value)


# -- what this peer answers ----------------------------------------------------------------------


READY = "ready"
LATE = "late"
GONE = "gone"
WAIT = "wait"
_PACE_WEIGHT = 0.3  # weight of the newest interval in this peer's pace (moving average)
_PACE_JUMP = 3.0  # one interval counts for at most this many paces (a freeze is not a new pace)
_HOLD_WINDOW = 4  # the hold covers the longest of this peer's last intervals, not only its mean


@dataclass(frozen=True)
class Verdict:
    """How to answer a request now: ``ready``, ``late``, ``gone``, or ``wait`` (until ``until``,
    or until this peer opens a key, then decide again)."""

    kind: str
    until: float | None = None


class GroupHandshakes:
    """Both sides of the handshake, as state: which keys this peer opened, when, with which
    hold, its pace, and the partners it left out per key.

    Answering: a request is answered with this peer's proposal once this peer has opened the
    key itself (``ready``); ``gone`` when it opened the key longer ago than its hold plus the
    grace (it has averaged and moved on), already opened a later step, or left (``leave``: it
    steps no more); for a step it has not reached, held up to the asker's hold and then ``late`` —
    or ``late`` at once when its own expected arrival (last sync plus pace) falls after that hold.
    One long interval (the peer was frozen or suspended) moves the pace by at most ``_PACE_JUMP``
    paces, so a peer back from a freeze is not taken for a straggler for many steps after. Keys that
    name no step are answered at once. Asking: ``settle`` turns the answers into the group and
    declines every proposed partner left out, so both sides reach the same verdict.
    """

    def __init__(self, config: GossipGroupsConfig) -> None:
        self.config = config
        self._opened: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key: (when, hold asked)
        self._declined: OrderedDict[str, set[str]] = OrderedDict()
        self._latest_step: int | None = None
        self._latest_at: float | None = None
        self._pace: float | None = None  # seconds between two of this peer's step syncs
        self._recent: deque[float] = deque(maxlen=_HOLD_WINDOW)  # its last intervals (clamped)
        self._left = False  # this peer stopped stepping: every request is answered gone

    @property
    def latest_step(self) -> int | None:
        return self._latest_step

    @property
    def pace(self) -> float | None:
        return self._pace

    @property
    def hold_pace(self) -> float | None:
        """The period this peer's hold is made of: the longest of its pace and its last
        ``_HOLD_WINDOW`` intervals. A peer that averaged alone for a step or two (short
        intervals) still holds for partners coming out of a full exchange (a long one)."""
        if self._pace is None:
            return None
        return max([self._pace, *self._recent])

    def begin(self, now: float) -> None:
        """This peer's first inner phase starts at ``now``: the interval to its first sync is
        its first pace. Before, a peer had no pace until its second sync, and a straggler was
        held for (not told ``late``) by every partner until then."""
        if self._latest_at is None:
            self._latest_at = now

    def open(self, key: str, now: float) -> float:
        """This peer asks for ``key`` now (its step reached the sync); returns the hold it asks
        its partners for (``GossipGroupsConfig.hold_for`` of its pace)."""
        if key in self._opened:
            return self._opened[key][1]
        step = step_of(key)
        if step is not None and (self._latest_step is None or step > self._latest_step):
            if self._latest_at is not None:
                interval = now - self._latest_at
                if self._pace is not None:
                    interval = min(interval, _PACE_JUMP * self._pace)
                self._recent.append(interval)
                self._pace = interval if self._pace is None else (
                    _PACE_WEIGHT * interval + (1 - _PACE_WEIGHT) * self._pace
                )
            self._latest_step, self._latest_at = step, now
        hold = self.config.hold_for(self.hold_pace)
        self._opened[key] = (now, hold)
        while len(self._opened) > self.config.remembered_keys:
            self._opened.popitem(last=False)
        return hold

    def leave(self) -> None:
        """This peer steps no more (its training ended or failed): every request, held or new,
        is answered ``gone`` at once, so no partner holds for a step it will never open."""
        self._left = True

    @property
    def left(self) -> bool:
        return self._left

    def gone(self, key: str, now: float) -> bool:
        if self._left:
            return True
        opened = self._opened.get(key)
        if opened is not None and now - opened[0] > opened[1] + self.config.grace_s:
            return True
        step = step_of(key)
        return step is not None and self._latest_step is not None and step < self._latest_step

    def decide(
        self, key: str, *, asker: str, asked_at: float, now: float, hold_s: float | None = None,
        swarm_next: int | None = None,
    ) -> Verdict:
        """How to answer ``asker``'s request for ``key``, received at ``asked_at``, asking to be
        held up to ``hold_s`` (None: this peer's ``hold_s``; capped at ``max_hold_s``);
        ``swarm_next``: the step the swarm goes to next as this peer knows it (``SwarmStep``)."""
        if self.gone(key, now):
            return Verdict(GONE)
        if asker in self._declined.get(key, ()):
            return Verdict(LATE)
        if key in self._opened:
            return Verdict(READY)
        step = step_of(key)
        if step is None:
            return Verdict(READY)
        hold = min(self.config.hold_s if hold_s is None else hold_s, self.config.max_hold_s)
        until = asked_at + hold
        if now >= until:
            return Verdict(LATE)
        syncs = self._syncs_to(step, swarm_next)
        if syncs is None:
            return Verdict(LATE)  # it will jump past the step asked for
        if self._pace is not None and self._latest_at is not None and self._latest_at + self._pace * syncs > until:
            # a straggler relative to the asker: at its pace it opens the step asked for after
            # the asker's hold
            return Verdict(LATE)
        return Verdict(WAIT, until)

    def _syncs_to(self, step: int, swarm_next: int | None) -> int | None:
        """How many more syncs until this peer opens ``step`` (None: it never will). One per
        step from its latest — unless its next key is ``JUMP_BEHIND`` or more below the round
        the swarm reached (``swarm_next`` − 1, from ``SwarmStep``): then it jumps to
        ``swarm_next`` first, and never opens a step below that."""
        if self._latest_step is None:
            return 1
        after = self._latest_step + 1
        if swarm_next is not None and after <= swarm_next - 1 - JUMP_BEHIND:
            return None if swarm_next > step else 1 + step - swarm_next
        return max(1, step - self._latest_step)

    def decline(self, key: str, peer: str) -> None:
        """``peer`` is out of this peer's group for ``key``."""
        self._declined.setdefault(key, set()).add(peer)
        while len(self._declined) > self.config.remembered_keys:
            self._declined.popitem(last=False)

    def declined(self, key: str) -> frozenset[str]:
        return frozenset(self._declined.get(key, ()))

    def settle(
        self, key: str, me: str, proposal: Sequence[str], answers: Mapping[str, Reply]
    ) -> tuple[str, ...]:
        """The group for ``key`` from the partners' ``answers`` (those asked and answered):
        ``me`` and each partner whose proposal holds ``me`` and that neither side declined.
        Every other proposed partner is declined, so a request it sends for the key later is
        answered ``late`` and it leaves this peer out too (the verdicts agree)."""
        for partner, reply in answers.items():
            if reply.late:
                self.decline(key, partner)
        declined = self.declined(key)
        group = confirmed_group(me, proposal, {p: r.group for p, r in answers.items() if p not in declined})
        for partner in proposal:
            if partner not in group:
                self.decline(key, partner)
        return group

    def answer(self, key: str, proposal: Sequence[str], verdict: Verdict, *, asker: str) -> dict[str, object]:
        """The reply for a final verdict (``late`` declines the asker for the key)."""
        message: dict[str, object] = {}
        if verdict.kind == GONE:
            message["gone"] = True
        elif verdict.kind == LATE:
            self.decline(key, asker)
            message["late"] = True
        elif verdict.kind == READY:
            message["group"] = list(proposal)
        else:
            raise ValueError(f"no reply for verdict {verdict.kind!r}")
        if self._latest_step is not None:
            message["step"] = self._latest_step
        return message


class SwarmStep:
    """Where the swarm is, from the steps partners announced in their answers and requests.

    ``heard(peer, step)`` keeps each of the last ``remembered`` peers' highest step;
    ``next_step(members)`` is the step after the highest one that another peer vouches for (it
    announced a step at most ``VOUCH_SLACK`` below) — so one peer announcing a far step moves
    nobody — or, in a view of at most ``SMALL_VIEW`` members (this peer included), where it
    hears about one partner per step and two vouching within two steps may take many steps,
    after the highest step heard; None when nothing usable was heard.
    """

    VOUCH_SLACK = 2
    SMALL_VIEW = 4

    def __init__(self, remembered: int = 8) -> None:
        self.remembered = remembered
        self._steps: OrderedDict[str, int] = OrderedDict()

    def heard(self, peer: str, step: int) -> None:
        self._steps[peer] = max(step, self._steps.pop(peer, step))
        while len(self._steps) > self.remembered:
            self._steps.popitem(last=False)

    def next_step(self, members: int) -> int | None:
        steps = sorted(self._steps.values(), reverse=True)
        if members <= self.SMALL_VIEW:
            return steps[0] + 1 if steps else None
        for i, step in enumerate(steps[:-1]):
            if steps[i + 1] >= step - self.VOUCH_SLACK:
                return step + 1
        return None
