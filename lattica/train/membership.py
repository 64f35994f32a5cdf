"""Who else trains in the run, as one peer saw it recently: the basis for "did I run alone?".

Theory of operation: a round of one is an ordinary round when this peer is the run's only
trainer, and a round run alone when others train — then it must not be published (it would
offer the others a minority state) and the peer catches up on theirs (``service.py``). Live
leases alone cannot tell the two apart: seen from a peer whose link was cut, every other lease
runs out after a few seconds, and that peer would take itself for the whole run, publish every
round it runs alone and race ahead of the run (a round of one takes no time), only to have
those rounds replaced when the link comes back.

So a trainer whose lease ran out is remembered for ``memory_s`` while we still hold a
connection to it: a cut link breaks no connection (the packets just vanish), whereas a killed
or crashed peer's connections drop at once — then the survivors *are* the run, and a restarting
peer should find their rounds published. A member that left cleanly or finished (``done``: it
waits for no round of ours) is forgotten at once. A member seen ``joining`` is neither
refreshed nor forgotten: every replica turns ``joining`` for the moment it fetches a state.

Sans-IO: ``observe`` takes the replicated member records, the live and the connected ids and a
time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

TRAINER_ROLE, DONE_ROLE = "trainer", "done"


class RecentTrainers:
    """The other trainers of the run: live ones, and connected ones that went silent less than
    ``memory_s`` ago."""

    def __init__(self, *, peer_id: str, memory_s: float) -> None:
        if memory_s < 0:
            raise ValueError(f"RecentTrainers memory_s must be >= 0, got {memory_s}")
        self.peer_id, self.memory_s = peer_id, memory_s
        self._seen: dict[str, float] = {}  # peer -> last time it was a live trainer

    def observe(
        self, members: Mapping[str, Mapping[str, Any]], live: Iterable[str], connected: Collection[str],
        now: float,
    ) -> None:
        live = set(live)
        for peer in live - {self.peer_id}:
            role = (members.get(peer) or {}).get("role")
            if role == TRAINER_ROLE:
                self._seen[peer] = now
            elif role == DONE_ROLE:
                self._seen.pop(peer, None)
        for peer, seen in list(self._seen.items()):
            gone = peer not in live and peer not in connected  # killed: its connections dropped
            if gone or now - seen > self.memory_s or (members.get(peer) or {}).get("left") is True:
                del self._seen[peer]

    def others(self) -> set[str]:
        return set(self._seen)
