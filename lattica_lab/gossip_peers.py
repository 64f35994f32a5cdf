"""Connected ``GossipGroups`` on real in-process libp2p hosts on loopback, for tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.coordination.gossip import GossipGroups
from lattica.coordination.groups import GossipGroupsConfig
from lattica.net.host import build_host

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


async def run_host(host: IHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``host`` on a loopback port until cancelled (``await nursery.start(run_host, host)``)."""
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def gossip_peers(
    nursery: trio.Nursery, count: int, *, grace_s: float,
    views: Callable[[str, list[str]], Sequence[str]] | None = None,
    max_hold_s: float = GossipGroupsConfig.max_hold_s,
) -> dict[str, GossipGroups]:
    """``count`` running, fully connected peers by id; ``views(me, everyone)``: the members ``me``
    holds (default: everyone). ``max_hold_s``: the longest hold a peer asks for or grants
    (``GossipGroupsConfig``) — peers that step back to back without inner work, each drawn with
    a peer that does not step, ask for twice their last interval, i.e. double it each step."""
    config = GossipGroupsConfig(grace_s=grace_s, max_hold_s=max_hold_s)
    ids: list[str] = []
    peers: dict[str, GossipGroups] = {}
    for _ in range(count):
        host = build_host(create_new_key_pair())
        await nursery.start(run_host, host)
        me = host.get_id().to_base58()
        ids.append(me)
        members = (lambda me=me: views(me, ids)) if views is not None else (lambda: list(ids))
        peers[me] = GossipGroups(
            host, peer_id=me, run_id="run", members=members, config=config
        )
        await nursery.start(peers[me].run)
    hosts = [p.host for p in peers.values()]
    for i, host in enumerate(hosts):
        for other in hosts[i + 1 :]:
            await host.connect(info_from_p2p_addr(other.get_addrs()[0]))
    return peers
