"""Coordination outside the training loop: who syncs with whom at each outer step.

``provider.GroupProvider`` is what strategies ask. Two implementations: ``rounds`` (the round
coordinator, ``/lattica/round/1.0.0``: one coordinator per sync key seals one group for all)
and ``gossip`` (``GossipGroups``, no coordinator and no global barrier), whose pure core is
``groups`` (a key's random permutation, stripes, pairwise confirmation, the answering side's
state).
"""

from lattica.coordination.groups import (
    DEFAULT_GROUP_SIZE,
    GossipGroupsConfig,
    GroupHandshakes,
    SwarmStep,
    confirmed_group,
    draw_step_groups,
    proposed_group,
    step_order,
)
from lattica.coordination.provider import GroupProvider

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GossipGroupsConfig",
    "GroupHandshakes",
    "GroupProvider",
    "SwarmStep",
    "confirmed_group",
    "draw_step_groups",
    "proposed_group",
    "step_order",
]
