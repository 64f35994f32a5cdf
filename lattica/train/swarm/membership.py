"""The run's members as training sees them: the one reader of the replicated state's schema.

``MembershipView`` is a typed view over ``ReplicatedState``: live members and their roles
(``joining`` until a trainer can sync, ``trainer``, ``done``, ``failed`` when its training
stopped on an error — its daemon stays up, but it trains no more), heartbeats, the published
``(round, weights hash)`` records, the run config and SPES's expert claims, and the writes
training makes (role, device, progress, run config, owned experts). Nothing else in
``lattica.train`` reads the state's documents by key.

Who else trains in the run, as one peer saw it recently, is the basis for "did I run alone?".

Theory of operation: a round of one is an ordinary round when this peer is the run's only
trainer, and a round run alone when others train — then it is not published at once (it would
offer the others a minority state) and the peer catches up on theirs, publishing its own only
when none came (``service.py``). Live
leases alone cannot tell the two apart: seen from a peer whose link was cut, every other lease
runs out after a few seconds, and that peer would take itself for the whole run, publish every
round it runs alone and race ahead of the run (a round of one takes no time), only to have
those rounds replaced when the link comes back.

So a trainer whose lease ran out is remembered for ``memory_s`` while we still hold a
connection to it: a cut link breaks no connection (the packets just vanish), whereas a killed
or crashed peer's connections drop at once — then the survivors *are* the run, and a restarting
peer should find their rounds published. A member that left cleanly, finished (``done``: it
waits for no round of ours) or failed is forgotten at once, as is one with a role this version
does not know (a role is a peer's untrusted claim: anything but ``trainer`` and ``joining`` is
no trainer). A member seen ``joining`` is neither refreshed nor forgotten: every replica turns
``joining`` for the moment it fetches a state.

Sans-IO: ``observe`` takes the replicated member records, the live and the connected ids and a
time.

A published ``(round, hash)`` is a claim too: a member can claim round 999 with a hash nobody
holds. ``UnservableClaims`` remembers the claims that no holder could serve when we tried to
fetch them. Such a claim stays out of the decisions about rounds (who is behind, who may
coordinate) until a fetch of it succeeds, and it is offered for adoption again only after a
back-off (``base_s``, doubling with every further failure up to ``max_s``) — so it costs one
failed fetch per period, not a fetch loop, and moves nobody's rounds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from lattica.crdt.documents import MemberRecord, ProgressRecord
from lattica.crdt.liveness import present

if TYPE_CHECKING:
    from lattica.train.ports import RunState

JOINING_ROLE, TRAINER_ROLE, DONE_ROLE, FAILED_ROLE = "joining", "trainer", "done", "failed"
TRAINING_ROLES = (JOINING_ROLE, TRAINER_ROLE, DONE_ROLE)  # a member that trains, or trained to the end


class MembershipView:
    """Typed reads and writes of the replicated run state, as this peer (``peer_id``) sees it."""

    def __init__(self, state: RunState, *, peer_id: str) -> None:
        self.state, self.peer_id = state, peer_id
        self._interval: tuple[int, float] | None = None  # (second, heartbeat interval then)

    # -- reads ------------------------------------------------------------------------------

    def live(self) -> list[str]:
        """Verified members whose lease is current (this peer included)."""
        return self.state.live_members()

    def members(self) -> Mapping[str, MemberRecord]:
        return self.state.snapshot().get("members", {})

    def role(self, peer: str) -> str | None:
        record = self.members().get(peer)
        return record.get("role") if record is not None else None

    def live_with_role(self, *roles: str) -> list[str]:
        return [p for p in self.live() if self.role(p) in roles]

    def trainers(self) -> list[str]:
        """Live members that train and can sync now."""
        return self.live_with_role(TRAINER_ROLE)

    def failed(self) -> list[str]:
        """Live members whose training stopped on an error (their daemons still run)."""
        return self.live_with_role(FAILED_ROLE)

    def advertised_reachability(self) -> dict[str, str]:
        """peer -> the reachability each member advertises (its own claim: public, private, unknown)."""
        members = self.members()
        return {peer: text for peer, record in members.items() if isinstance(text := record.get("reachability"), str)}

    def heartbeat(self, peer: str) -> int | None:
        """The counter ``peer`` bumps with every lease renewal (None: no record)."""
        record = self.members().get(peer)
        return record.get("heartbeat") if record is not None else None

    @property
    def heartbeat_interval(self) -> float:
        """How often members renew their leases now: the slower the more members (``LeasePolicy``)."""
        now_ms = time.time_ns() // 1_000_000
        if self._interval is None or self._interval[0] != now_ms // 1000:
            members = present(self.members())
            self._interval = (now_ms // 1000, self.state.config.lease.interval_for(members))
        return self._interval[1]

    @property
    def admins(self) -> tuple[str, ...]:
        return tuple(sorted(self.state.admins))

    def progress(self) -> Mapping[str, ProgressRecord]:
        """Every member's published ``(round, weights hash)``, live or not."""
        return self.state.snapshot().get("progress", {})

    def published_claim(self, peer: str) -> tuple[int, str | None] | None:
        """The round ``peer`` published and its hash; None when it published no round."""
        record = self.progress().get(peer)
        rnd = record.get("round") if record is not None else None
        return (rnd, record.get("weights_hash")) if record is not None and type(rnd) is int else None

    def newest_published_round(self) -> int:
        return max((c[0] for p in self.progress() if (c := self.published_claim(p)) is not None), default=0)

    def run_config(self) -> Mapping[str, object]:
        """The run config an admin published (empty when none)."""
        return self.state.snapshot().get("config", {})

    def expert_claims(self) -> Mapping[str, object]:
        """SPES: expert id -> the members claiming it (untrusted, see ``ownership.claimed_owners``)."""
        claims = self.state.snapshot().get("experts", {})
        return claims if isinstance(claims, Mapping) else {}

    # -- writes and waiting -----------------------------------------------------------------

    async def set_role(self, role: str) -> None:
        await self.state.update_member(role=role)

    async def set_device(self, description: str) -> None:
        await self.state.update_member(device=description)

    async def publish_progress(self, rnd: int, digest: str) -> None:
        await self.state.set_progress(rnd, digest)

    async def publish_run_config(self, config: dict[str, object]) -> None:
        """Raises ``LocalProtocolError`` when this peer is no admin."""
        await self.state.set_run_config(config)

    async def set_owned_experts(self, experts: list[str]) -> None:
        await self.state.set_owned_experts(experts)

    async def wait_changed(self) -> None:
        await self.state.wait_changed()


class RecentTrainers:
    """The other trainers of the run: live ones, and connected ones that went silent less than
    ``memory_s`` ago."""

    def __init__(self, *, peer_id: str, memory_s: float) -> None:
        if memory_s < 0:
            raise ValueError(f"RecentTrainers memory_s must be >= 0, got {memory_s}")
        self.peer_id, self.memory_s = peer_id, memory_s
        self._seen: dict[str, float] = {}  # peer -> last time it was a live trainer

    def observe(
        self, members: Mapping[str, Mapping[str, object]], live: Iterable[str], connected: Collection[str],
        now: float,
    ) -> None:
        live = set(live)
        for peer in live - {self.peer_id}:
            role = (members.get(peer) or {}).get("role")
            if role == TRAINER_ROLE:
                self._seen[peer] = now
            elif role != JOINING_ROLE:  # done, failed, or a role we do not know: no trainer
                self._seen.pop(peer, None)
        for peer, seen in list(self._seen.items()):
            gone = peer not in live and peer not in connected  # killed: its connections dropped
            if gone or now - seen > self.memory_s or (members.get(peer) or {}).get("left") is True:
                del self._seen[peer]

    def others(self) -> set[str]:
        return set(self._seen)


Claim = tuple[int, str]  # round, weights hash


class UnservableClaims:
    """``(round, hash)`` claims that no holder could serve: distrusted until served, retried
    for adoption after a doubling back-off."""

    def __init__(self, *, base_s: float = 5.0, max_s: float = 300.0, max_claims: int = 256) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"UnservableClaims needs 0 < base_s <= max_s, got {base_s}, {max_s}")
        self.base_s, self.max_s, self.max_claims = base_s, max_s, max_claims
        self._claims: OrderedDict[Claim, tuple[float, int]] = OrderedDict()  # -> (retry at, failures)

    def failed(self, claim: Claim, now: float) -> float:
        """Record a failed fetch of ``claim``; returns the back-off before it is offered again."""
        failures = self._claims.pop(claim, (0.0, 0))[1] + 1
        period = min(self.max_s, self.base_s * 2.0 ** (failures - 1))
        self._claims[claim] = (now + period, failures)
        while len(self._claims) > self.max_claims:
            self._claims.popitem(last=False)
        return period

    def served(self, claim: Claim) -> None:
        """A fetch of ``claim`` succeeded: it is trusted again."""
        self._claims.pop(claim, None)

    def distrusted(self, claim: tuple[int, str | None]) -> bool:
        """Whether a fetch of ``claim`` failed and none succeeded since."""
        return claim in self._claims

    def backing_off(self, claim: Claim, now: float) -> bool:
        entry = self._claims.get(claim)
        return entry is not None and now < entry[0]

    def trusted_progress(self, progress: Mapping[str, ProgressRecord], now: float) -> dict[str, ProgressRecord]:
        """The published progress records, without the claims still backing off (those due
        for a retry stay: adopting one is the retry)."""
        return {
            peer: record for peer, record in progress.items()
            if (claim := _claim_of(record)) is None or not self.backing_off(claim, now)
        }


def _claim_of(record: object) -> Claim | None:
    if not isinstance(record, Mapping):
        return None
    rnd, digest = record.get("round"), record.get("weights_hash")
    return (rnd, digest) if type(rnd) is int and isinstance(digest, str) else None
