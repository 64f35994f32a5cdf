"""``GroupProvider``: what a strategy asks to learn who takes part in one sync.

Implementations: ``rounds.RoundCoordinator`` (one coordinator per sync key, every member gets
the same group) and ``gossip.GossipGroups`` (small groups each peer derives and confirms with
its partners, no coordinator). Tests answer with a fixed list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class GroupProvider(Protocol):
    async def group_for(self, key: str) -> Sequence[str]:
        """The agreed, identically ordered member list (including this node) for sync ``key``.

        ``key`` names one sync uniquely in the run, e.g. ``"round/12"`` or
        ``"round/12/fragment/1"``. Peers that miss the deadline are left out.
        """
        ...


@runtime_checkable
class SwarmStepSource(Protocol):
    """A provider that knows where the swarm is (``gossip.GossipGroups``): a strategy whose next
    sync key is below the swarm's step jumps there instead of drawing groups for a step the others
    have left. The round coordinator does not need it (every member gets the same round)."""

    def next_step(self) -> int | None:
        """The step the swarm goes to next, as partners announced it (None: nothing heard)."""
        ...
