"""Which published outer states this replica may adopt (sans-IO).

Theory of operation
-------------------
A member's published ``(round, weights hash)`` is a claim, and adopting one replaces this
replica's weights. With gossip every replica's hash differs, so a claim has one holder and the
newest round wins; where replicas agree a tie between lone holders also goes to the newest round.
One member could therefore move every replica onto whatever state it serves. ``ClaimScreen``
stands between the published claims and ``outer_transfer.agreed_round`` / ``repair_target``:

Before any fetch (``admissible``), a claim is left out, and logged once per holder and reason,
when:

1. its round is beyond the run's ``rounds`` (once the run's config is agreed);
2. it is implausibly far ahead: more than ``max_rounds_ahead`` rounds beyond the newest round
   published by a live, verified member that trains (or finished) and does not hold it — when
   there is such a member (ourselves excluded: a replica that was stopped or restarted is behind
   the run, and must still be able to adopt its state). Where the replicas agree and the claim's
   verified holders outnumber those other members, the holders' own word carries it: several
   members restarted at once lag the run together, and their stale rounds must not keep the
   others' agreed state from them;
3. the replicas of the run agree (all-reduce), the run has more than two live members, the claim
   is ahead of this replica's round, and only one verified member holds it: moving forward takes
   the word of two (a lone holder is followed only at or below our round — the tie-break that
   re-converges replicas which each ran a round alone — in a run of two, where nobody else
   could confirm anything, and when neither this replica nor any other member has a round yet: a founder that
   trained alone before the others came is the run's only progress, and refusing it would leave
   the newcomers at round 0 and the founder ahead, never in one collective).

These refusals cost no fetch and score nobody down: an honest member can be ahead (partitioned,
or the run's config not agreed yet), and it is adopted once the rule no longer holds.

After a fetch, a state whose bytes match the claim but fail the checks (``state_schema``,
finiteness, its counters against the claimed round) is evidence against everyone who published
that hash: ``refuse`` refuses the claim for good (the same bytes fail again), and puts each holder
in a ``PenaltyBox``: its claims are left out for ``ban_s`` (silently: the refusal was logged), and
it is counted in ``refusals``. A holder that keeps publishing bad states therefore costs one fetch
and one log line per ``ban_s``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from lattica.crdt.documents import ProgressRecord
from lattica.dht.penalties import PenaltyBox

Claim = tuple[int, str]  # round, weights hash
Key = TypeVar("Key")


@dataclass(frozen=True, kw_only=True)
class AdoptionLimits:
    max_rounds_ahead: int = 8  # K: a claim more than K rounds beyond every other member's is refused
    ban_s: float = 600.0  # a holder that served a bad state: its claims left out this long
    max_remembered: int = 256  # refused claims and logged (holder, reason) pairs kept

    def __post_init__(self) -> None:
        if self.max_rounds_ahead < 0 or self.ban_s <= 0 or self.max_remembered < 1:
            raise ValueError(f"AdoptionLimits needs max_rounds_ahead >= 0, ban_s > 0, max_remembered >= 1: {self}")


@dataclass(frozen=True, kw_only=True)
class RunPicture:
    """What the rules need to know of the run, as this replica sees it now."""

    me: str
    live: Collection[str]  # verified members whose lease is current
    reporters: Collection[str]  # live members that train or finished: their rounds are reports
    members: int  # live members of the run (training roles), ourselves included
    my_round: int  # rounds this replica completed
    rounds: int | None  # the run's rounds (None: its config is not agreed yet)
    replicas_agree: bool


@dataclass(frozen=True)
class Refusal:
    claim: Claim
    holders: tuple[str, ...]
    reason: str
    kind: str  # "beyond", "ahead", "alone" or "invalid"

    def describe(self) -> str:
        return f"refused the outer state of round {self.claim[0]} claimed by {', '.join(self.holders)}: {self.reason}"


def claim_of(record: object) -> Claim | None:
    if not isinstance(record, Mapping):
        return None
    rnd, digest = record.get("round"), record.get("weights_hash")
    return (rnd, digest) if type(rnd) is int and isinstance(digest, str) and digest and rnd > 0 else None


def refusal_before_fetch(
    claim: Claim, holders: Sequence[str], reports: Mapping[str, int], run: RunPicture, limits: AdoptionLimits,
) -> Refusal | None:
    """The rule (module docstring, 1-3) that leaves ``claim`` out, or None when it may be fetched.
    ``reports``: the rounds published by the run's reporters (holders and ourselves not excluded yet)."""
    rnd = claim[0]
    holders = tuple(sorted(holders))
    if run.rounds is not None and rnd > run.rounds:
        return Refusal(claim, holders, f"beyond the run's {run.rounds} rounds", "beyond")
    others = [r for peer, r in reports.items() if peer not in holders and peer != run.me]
    outvoted = run.replicas_agree and len(holders) >= 2 and len(holders) > len(others)
    if others and not outvoted and rnd > max(others) + limits.max_rounds_ahead:
        return Refusal(
            claim, holders,
            f"{rnd - max(others)} rounds beyond any other member's round {max(others)} "
            f"(at most {limits.max_rounds_ahead})", "ahead",
        )
    if (run.replicas_agree and run.members > 2 and len(holders) < 2 and rnd > run.my_round
            and (others or run.my_round > 0)):
        return Refusal(claim, holders, f"ahead of our round {run.my_round} and held by no other member", "alone")
    return None


class ClaimScreen:
    """The claims that may be adopted, the holders scored down (module docstring)."""

    def __init__(self, limits: AdoptionLimits | None = None) -> None:
        self.limits = limits or AdoptionLimits()
        self.penalties = PenaltyBox(ban_seconds=self.limits.ban_s)
        self.refusals: Counter[str] = Counter()  # holder -> bad states it served
        self._refused: OrderedDict[Claim, None] = OrderedDict()
        self._noted: OrderedDict[tuple[str, str], None] = OrderedDict()  # (holder, kind) logged

    def admissible(
        self, progress: Mapping[str, ProgressRecord], run: RunPicture, *, now: float,
    ) -> tuple[dict[str, ProgressRecord], list[Refusal]]:
        """``progress`` without the records whose claims may not be adopted, and the refusals
        not reported before (to log)."""
        claims = self._claims(progress, run, now)
        reports = {peer: claim[0] for peer, claim in claims.items() if peer in run.reporters}
        holders: dict[Claim, list[str]] = {}
        for peer, claim in claims.items():
            holders.setdefault(claim, []).append(peer)
        refused: set[Claim] = set()
        new: list[Refusal] = []
        for claim, peers in holders.items():
            refusal = refusal_before_fetch(claim, peers, reports, run, self.limits)
            if refusal is not None:
                refused.add(claim)
                if self._first(refusal):
                    new.append(refusal)
        kept = {
            peer: record for peer, record in progress.items()
            if peer == run.me or (not self._left_out(peer, record, now) and claims.get(peer) not in refused)
        }
        return kept, new

    def _claims(self, progress: Mapping[str, ProgressRecord], run: RunPicture, now: float) -> dict[str, Claim]:
        """The claims of live members other than us that are neither refused nor banned."""
        live = set(run.live)
        claims = {}
        for peer, record in progress.items():
            claim = claim_of(record)
            if peer in live and peer != run.me and claim is not None and not self._left_out(peer, record, now):
                claims[peer] = claim
        return claims

    def _left_out(self, peer: str, record: object, now: float) -> bool:
        claim = claim_of(record)
        return (claim is not None and claim in self._refused) or self.penalties.is_banned(peer, now=now)

    def _first(self, refusal: Refusal) -> bool:
        """Whether this (holder, reason) was not reported yet."""
        keys = [(holder, refusal.kind) for holder in refusal.holders]
        if all(key in self._noted for key in keys):
            return False
        for key in keys:
            _remember(self._noted, key, self.limits.max_remembered)
        return True

    def refuse(self, claim: Claim, holders: Sequence[str], reason: str, *, now: float) -> Refusal:
        """A fetched state of ``claim`` failed the checks: refuse it for good, score its holders down."""
        _remember(self._refused, claim, self.limits.max_remembered)
        for holder in holders:
            self.penalties.reject(holder, "invalid outer state", now=now)
            self.refusals[holder] += 1
        return Refusal(claim, tuple(sorted(holders)), reason, "invalid")


def _remember(seen: OrderedDict[Key, None], key: Key, limit: int) -> None:
    seen.pop(key, None)
    seen[key] = None
    while len(seen) > limit:
        seen.popitem(last=False)


__all__ = ["AdoptionLimits", "ClaimScreen", "Refusal", "RunPicture", "claim_of", "refusal_before_fetch"]
