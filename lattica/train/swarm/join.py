"""Joining a running swarm: fetch the outer state from several holders, verify, adopt.

Theory of operation
-------------------
Every member publishes, for its last completed round, the hash of its outer state in flat form
(``outer_state.outer_state_hash``: named tensors plus the ``meta/json`` manifest).

A joiner picks the holders that published the newest round with the same hash and calls
``fetch_outer_state``:

1. it fetches ``meta/json`` from the first holder that answers and reads the manifest;
2. the tensor names are dealt round-robin to the holders and fetched in parallel through the
   caller's ``fetch(peer, names)`` (the data plane); a holder that fails has its share re-dealt
   to the remaining holders;
3. the assembled state must hash to ``expected_hash``; if it does not (someone sent wrong
   bytes), every holder is tried alone, in turn, and only a state whose hash matches is
   accepted. A holder whose state mismatches is reported as a ``RemoteProtocolError``. When
   instead every holder failed in step 2, the fetch fails at once (``PeerUnavailableError``):
   asking each holder alone again waited on a silent one (its link cut) for 4-6 s in the chaos
   benchmark, for a state the others had already stopped offering — the run had moved on, and
   its newer state is the one to fetch.

A holder that has gone silent — its link cut, so its connection neither answers nor breaks for
many seconds — must not hold the fetch: the holders move on every round and keep only their last
few rounds on offer, so a fetch held that long finds the state gone. ``FetchPacing`` bounds it:
a request for the manifest (and the ``first_answer`` probe of a claim) asks the next holder too
once one has been silent for ``hedge_s``, and takes the first answer; in the parallel fetch, once
one holder delivered its share, a holder still busy ``straggler_factor`` times that long (at least
``straggler_min_s``) counts as failed and its share is re-dealt to the others.

The result is held to the joiner's own outer state (``state_schema.check_outer_state``: names,
shapes, dtypes, finite values, the manifest's entries) and goes into ``Trainer.adopt_outer_state``;
the joiner takes part from the next round. Which claims are fetched at all: ``adoption.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import trio

from lattica.errors import BrokenError, PeerUnavailableError, RemoteError, RemoteProtocolError
from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.outer_state import MANIFEST, read_manifest

log = logging.getLogger(__name__)

Fetch = Callable[[str, Sequence[str]], Awaitable[Mapping[str, torch.Tensor]]]
_FETCH_ERRORS = (PeerUnavailableError, BrokenError, RemoteProtocolError)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class FetchPacing:
    """How long a silent holder may hold a fetch (module docstring)."""

    hedge_s: float = 1.0
    straggler_min_s: float = 1.0
    straggler_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.hedge_s <= 0 or self.straggler_min_s <= 0:
            raise ValueError("FetchPacing hedge_s and straggler_min_s must be > 0")
        if self.straggler_factor < 1:
            raise ValueError(f"FetchPacing straggler_factor must be >= 1, got {self.straggler_factor}")


async def first_answer(
    holders: Sequence[str], ask: Callable[[str], Awaitable[T]], *, hedge_s: float
) -> tuple[str, T]:
    """The first answer of ``ask(holder)``: holders are asked in order, the next one as soon as
    the last asked failed or stayed silent for ``hedge_s``; the others are cancelled once one
    answered. Raises the last failure (a ``RemoteError``) when none answered."""
    answers: list[tuple[str, T]] = []
    failures: list[RemoteError] = []

    async def one(holder: str, finished: trio.Event, done: trio.CancelScope) -> None:
        try:
            answers.append((holder, await ask(holder)))
            done.cancel()
        except _FETCH_ERRORS as exc:
            failures.append(exc)
        finally:
            finished.set()

    async with trio.open_nursery() as nursery:
        for holder in holders:
            finished = trio.Event()
            nursery.start_soon(one, holder, finished, nursery.cancel_scope)
            with trio.move_on_after(hedge_s):
                await finished.wait()
    if answers:
        return answers[0]
    raise failures[-1] if failures else PeerUnavailableError("no holder answered")


async def fetch_outer_state(
    holders: Sequence[str], fetch: Fetch, *, expected_hash: str, pacing: FetchPacing = FetchPacing()
) -> dict[str, torch.Tensor]:
    """Fetch the manifest, then its tensors from ``holders`` in parallel; verify the hash."""
    if not holders:
        raise PeerUnavailableError("no peer holds the current outer state")

    async def ask_manifest(holder: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        manifest = await _fetch_checked(holder, [MANIFEST], fetch)
        return manifest, read_manifest(manifest, peer_id=holder).names

    _, (manifest, names) = await first_answer(holders, ask_manifest, hedge_s=pacing.hedge_s)
    last: RemoteError | None = None
    try:
        parallel = await _fetch_spread(list(holders), names, fetch, pacing)
        parallel.update(manifest)
        if weights_hash(parallel) == expected_hash:
            return parallel
        log.warning("outer state assembled from %d holders does not match; retrying", len(holders))
    except PeerUnavailableError as exc:
        # every holder failed or stalled: asking each alone again waits on the silent ones for
        # a state the others no longer offer (they moved on); the caller fetches the next claim
        log.warning("parallel fetch failed: %s", exc)
        raise
    for holder in holders:
        try:
            alone = await _fetch_checked(holder, [MANIFEST, *names], fetch)
        except _FETCH_ERRORS as exc:
            last = exc
            continue
        if weights_hash(alone) == expected_hash:
            return alone
        last = RemoteProtocolError("outer state does not match the published hash", peer_id=holder)
        log.warning("%s", last)
    raise last or PeerUnavailableError("no holder served the outer state")


async def _fetch_spread(
    holders: list[str], names: list[str], fetch: Fetch, pacing: FetchPacing
) -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = {}
    pending, alive = names, holders
    while pending:
        if not alive:
            raise PeerUnavailableError("every holder failed during the parallel fetch")
        shares = {h: pending[i :: len(alive)] for i, h in enumerate(alive) if pending[i :: len(alive)]}
        delivered = await _fetch_shares(shares, fetch, result, pacing)
        alive = [h for h in alive if h in delivered or h not in shares]
        pending = [n for n in pending if n not in result]
    return result


async def _fetch_shares(
    shares: Mapping[str, list[str]], fetch: Fetch, result: dict[str, torch.Tensor], pacing: FetchPacing
) -> set[str]:
    """Fetch each holder's share at once into ``result``; the holders that delivered theirs.
    Once the first share arrived, the rest get ``straggler_factor`` times as long (at least
    ``straggler_min_s``); a holder still busy then is cancelled and counts as failed."""
    delivered: set[str] = set()
    running, started = len(shares), trio.current_time()
    first_in, watch = trio.Event(), trio.CancelScope()

    async def share_of(holder: str, names: list[str]) -> None:
        nonlocal running
        try:
            result.update(await _fetch_checked(holder, names, fetch))
            delivered.add(holder)
            first_in.set()
        except _FETCH_ERRORS as exc:
            log.warning("holder failed: %s", exc)
        finally:
            running -= 1
            if running == 0:
                watch.cancel()

    async def cut_stragglers(shares_scope: trio.CancelScope) -> None:
        with watch:
            await first_in.wait()
            await trio.sleep(max(pacing.straggler_min_s, pacing.straggler_factor * (trio.current_time() - started)))
            late = [h for h in shares if h not in delivered]
            log.info("too slow, its share goes to the other holders: %s", ", ".join(late))
            shares_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut_stragglers, nursery.cancel_scope)
        for holder, names in shares.items():
            nursery.start_soon(share_of, holder, names)
    return delivered


async def _fetch_checked(holder: str, names: list[str], fetch: Fetch) -> dict[str, torch.Tensor]:
    got = await fetch(holder, names)
    if set(got) != set(names) or not all(isinstance(t, torch.Tensor) for t in got.values()):
        raise RemoteProtocolError("holder sent a different set of tensors", peer_id=holder)
    return dict(got)
