"""All-gather of sparse payloads: every member sends its encoded contribution to each other one.

Sparse contributions of different members touch different entries, so they cannot be summed
part by part on the way like a butterfly all-reduce does; each member receives the M − 1 other
payloads and sums the decoded entries itself, in fp32 and in group order, so every member gets
the same bits. A member sends its payload M − 1 times — at 1–3 % density that is still a small
fraction of one dense all-reduce (``2 (M − 1) / M`` of the dense fp32 size).

Failure: one exchange that fails (a peer gone, a broken stream, a malformed payload) cancels
the other exchanges of the call and fails the whole gather with that error; the caller
decides (retry with a fresh group, or skip the sync). A payload that does not decode (a lying
header, a non-finite scale or value) is reported as a refused contribution of its sender too.

Screening (``screen_gathered``): of a gathered list, the contributions are judged by the
all-reduce owner's rules (``numerics.screen.accepted_members`` on their decoded values: a
non-finite one refused, with three or more one above ``max_norm_ratio`` × the median norm).
Every member judges the same list the same way, so replicas still apply the same mean; an
all-gather of two has no majority, and only non-finite values are refused there (the
decoder already refuses them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError, RemoteProtocolError
from lattica.numerics.partner_screen import PartnerScreen
from lattica.numerics.screen import ContributionScreen, Rejection, accepted_members
from lattica.train.engine.collective import Collective
from lattica.train.strategies.base import GroupProvider

log = logging.getLogger(__name__)
T = TypeVar("T")
GATHER_FAILURES = (PeerUnavailableError, BrokenError, RemoteProtocolError)


def gather_bytes(payload: Sequence[torch.Tensor], group_size: int) -> int:
    """What one member puts on the wire: its payload once to each of the others."""
    return sum(t.numel() * t.element_size() for t in payload) * max(group_size - 1, 0)


async def all_gather(
    collective: Collective,
    payload: list[torch.Tensor],
    *,
    group: Sequence[str],
    tag: str,
    decode: Callable[[list[torch.Tensor], str], T],
    own: T,
    on_refused: Callable[[Rejection], None] | None = None,
) -> list[T]:
    """Every member's decoded contribution, in ``group`` order (``own`` for this node).

    ``decode(tensors, peer)`` checks and rebuilds what ``peer`` sent; it raises
    ``RemoteProtocolError`` on anything that does not fit, which is reported to
    ``on_refused`` before the gather fails.
    """
    me = collective.peer_id
    received: dict[str, T] = {me: own}
    failures: list[Exception] = []

    async def one(peer: str) -> None:
        try:
            answer = await collective.exchange(payload, peer=peer, tag=tag, codec="raw")
            try:
                received[peer] = decode(answer, peer)
            except RemoteProtocolError as exc:
                if on_refused is not None:
                    on_refused(Rejection(peer, f"malformed payload: {exc}"))
                raise
        except GATHER_FAILURES as exc:
            failures.append(exc)
            nursery.cancel_scope.cancel()  # the gather cannot complete: stop waiting for the rest

    async with trio.open_nursery() as nursery:
        for peer in group:
            if peer != me:
                nursery.start_soon(one, peer)
    if failures:
        raise failures[0]
    return [received[member] for member in group]


@dataclass
class GatherOutcome(Generic[T]):
    """What ``gather_with_retries`` did: the contributions (None when every attempt failed),
    the group they came from, every byte put on the wire across attempts, the last failure."""

    gathered: list[T] | None
    group: tuple[str, ...]
    bytes_sent: int
    failure: str


async def gather_with_retries(
    collective: Collective,
    groups: GroupProvider,
    payload: list[torch.Tensor],
    *,
    key: str,
    tag: str,
    attempts: int,
    decode: Callable[[list[torch.Tensor], str], T],
    own: T,
    group: Sequence[str] | None = None,
    on_refused: Callable[[Rejection], None] | None = None,
) -> GatherOutcome[T]:
    """``all_gather`` in the group agreed for ``key`` (or in ``group`` when the caller already
    holds an agreed one: no agreement for the first attempt); after a failure, again in a fresh
    group (``key/retry/N``), up to ``attempts`` times. Attempt N's tag is ``tag/N``."""
    nbytes, failure = 0, ""
    for attempt in range(attempts):
        if attempt == 0 and group is not None:
            members = tuple(group)
        else:
            members = tuple(await groups.group_for(key if attempt == 0 else f"{key}/retry/{attempt}"))
        nbytes += gather_bytes(payload, len(members))
        try:
            gathered = await all_gather(
                collective, payload, group=members, tag=f"{tag}/{attempt}", decode=decode, own=own,
                on_refused=on_refused,
            )
        except GATHER_FAILURES as exc:
            failure = str(exc)
            log.info("sync %s attempt %d with %s failed: %s", key, attempt, ", ".join(members), exc)
            continue
        return GatherOutcome(gathered, members, nbytes, "")
    return GatherOutcome(None, (), nbytes, failure)


def screen_gathered(
    gathered: Sequence[T], group: Sequence[str], values: Callable[[T], torch.Tensor], screen: PartnerScreen,
    *, me: str,
) -> list[T]:
    """The contributions of ``gathered`` (one per member of ``group``, in order) that the
    all-reduce owner's rules accept (module docstring), judged on their decoded ``values`` (one
    flat tensor each); refusals of other members are reported to ``screen``. Empty when every
    contribution is refused: nothing to apply."""
    rules = ContributionScreen(max_norm_ratio=screen.max_norm_ratio)
    accepted, rejected = accepted_members([values(c) for c in gathered], group, rules)
    for rejection in rejected:
        if rejection.peer != me:
            screen.refuse(rejection)
    return [gathered[i] for i in accepted]
