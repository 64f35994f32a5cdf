"""Partners whose contributions this peer refused, left out of its group draws for a while.

Theory of operation
-------------------
When a replica refuses what a partner sent (``numerics.partner_screen``: a non-finite value, a
norm far above its own), it stops drawing that partner into its groups: for the next
``avoid_steps`` outer steps after the first refusal (8 by default), twice as many after the
second, and so on up to ``max_avoid_steps`` (512). Steps, not seconds, because a step is what
an exchange costs, however long a step takes on a given swarm.

Avoiding is local and needs no message: the partner is taken out of this peer's view before it
draws its stripe (``GossipGroups.proposal``), so this peer proposes a group without it and meets
others instead, and answers the partner's own requests with a proposal that does not hold it —
a pair is confirmed only when each side holds the other, so neither side counts it. A partner
that refused nobody is still drawn by the others; views then differ by one member for a while,
which shifts only the stripes after its position in the key's order
(``groups.step_order``). Offences are remembered for the life of the process (a restart
forgives); when the time is up the partner is drawn again, and a further refusal doubles the
time. ``avoided`` lists who is out at a step, for ``lattica status``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_AVOID_STEPS = 8
DEFAULT_MAX_AVOID_STEPS = 512


@dataclass(frozen=True, kw_only=True)
class AvoidanceConfig:
    avoid_steps: int = DEFAULT_AVOID_STEPS  # after the first refusal
    max_avoid_steps: int = DEFAULT_MAX_AVOID_STEPS  # the doubling stops here

    def __post_init__(self) -> None:
        if not 1 <= self.avoid_steps <= self.max_avoid_steps:
            raise ValueError(
                f"need 1 <= avoid_steps <= max_avoid_steps, got {self.avoid_steps} and {self.max_avoid_steps}"
            )


class PartnerAvoidance:
    """Who this peer leaves out of its draws until which step (module docstring)."""

    def __init__(self, config: AvoidanceConfig | None = None) -> None:
        self.config = config or AvoidanceConfig()
        self._offences: dict[str, int] = {}
        self._until: dict[str, int] = {}  # peer -> first step at which it is drawn again

    def refused(self, peer: str, *, step: int) -> int:
        """``peer``'s contribution was refused at ``step``: the first step it is drawn again."""
        offences = self._offences.get(peer, 0) + 1
        self._offences[peer] = offences
        steps = min(self.config.avoid_steps << min(offences - 1, 30), self.config.max_avoid_steps)
        self._until[peer] = max(self._until.get(peer, 0), step + 1 + steps)
        return self._until[peer]

    def avoids(self, peer: str, *, step: int) -> bool:
        return step < self._until.get(peer, 0)

    def drawable(self, members: Iterable[str], *, step: int) -> list[str]:
        """``members`` without those avoided at ``step``."""
        return [m for m in members if not self.avoids(m, step=step)]

    def avoided(self, *, step: int) -> list[str]:
        """The peers left out of draws at ``step``, sorted."""
        return sorted(p for p, until in self._until.items() if step < until)
