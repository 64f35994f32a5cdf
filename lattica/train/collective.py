"""The one seam between outer-step math and the network.

Outer strategies (DiLoCo, NoLoCo, Streaming DiLoCo, SPES) never touch sockets: they call a
``Collective``. The data plane implements it over real peers; ``lattica.testing`` implements it
in memory, so the same strategy code is tested both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Collective(Protocol):
    """Communication primitives over the peers of one outer round.

    ``group`` lists peer ids (strings) *including this node*, in the same order on every member.
    ``tag`` names the operation uniquely within the run (e.g. ``"diloco/round/12"``) so that
    concurrent or late messages never mix. Deadlines come from the caller's trio cancel scope.
    """

    @property
    def peer_id(self) -> str: ...

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        """Return the element-wise mean over ``group`` of each tensor (fp32 accumulation)."""
        ...

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        """Send ``tensors`` to ``peer`` and return the tensors it sent under the same tag."""
        ...
