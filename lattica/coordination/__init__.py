"""Coordination outside the training loop: who syncs with whom at each outer step.

``groups`` is the pure core (a key's random permutation, stripes, pairwise confirmation, the
answering side's state); ``gossip`` is its thin libp2p shell, ``GossipGroups``, a
``GroupProvider`` with no coordinator and no global barrier.
"""

from lattica.coordination.groups import (
    DEFAULT_GROUP_SIZE,
    GossipGroupsConfig,
    GroupHandshakes,
    confirmed_group,
    draw_step_groups,
    proposed_group,
    step_order,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GossipGroupsConfig",
    "GroupHandshakes",
    "confirmed_group",
    "draw_step_groups",
    "proposed_group",
    "step_order",
]
