"""Assembling a daemon: the node plus the run's services, chosen from the config."""

from __future__ import annotations

from libp2p.crypto.keys import KeyPair

from lattica.config import NodeConfig
from lattica.node import Node


def build_node(config: NodeConfig, key_pair: KeyPair) -> Node:
    node = Node(config, key_pair)
    return node
