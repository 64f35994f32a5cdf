"""A standard libp2p node with none of Lattica's protocols: py-libp2p's own services only.

It stands in for a relay or DHT server run by someone else (a go-libp2p or Kubo node): the
library's identify (and identify push), ping, Kademlia server (``KadDHT``) and circuit relay
v2 HOP service (``CircuitV2Protocol``), with the library's defaults. Nothing here knows of
Lattica; tests use it to check that a Lattica node works with, and is found through, any
libp2p peer.

In-process: ``async with standard_node(listen) as node``. As a process (in a lab namespace):
``python tests/net/standard_node.py --listen /ip4/…/tcp/4001`` prints JSON lines:
``{"event": "up", "peer_id", "addrs"}``, then answers ``{"cmd": "peer", "id": …}`` on stdin
with ``{"event": "peer", "id", "protocols", "addrs", "in_routing_table", "connected"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service


@dataclass
class StandardNode:
    host: IHost
    kad: KadDHT

    @property
    def peer_id(self) -> str:
        return self.host.get_id().to_base58()

    @property
    def addr(self) -> str:
        return str(self.host.get_addrs()[0])

    def describe(self, peer: str) -> dict[str, Any]:
        """What this node knows of ``peer``: from identify (protocols, addresses) and the DHT."""
        peer_id = ID.from_base58(peer)
        store = self.host.get_peerstore()
        try:
            protocols = sorted(str(p) for p in store.get_protocols(peer_id))
        except PeerStoreError:
            protocols = []
        try:
            addrs = [str(a) for a in store.addrs(peer_id)]
        except PeerStoreError:
            addrs = []
        return {
            "id": peer,
            "protocols": protocols,
            "addrs": addrs,
            "in_routing_table": self.kad.routing_table.peer_in_table(peer_id),
            "connected": peer_id in self.host.get_connected_peers(),
        }


@asynccontextmanager
async def standard_node(listen: str = "/ip4/127.0.0.1/tcp/0") -> AsyncIterator[StandardNode]:
    addr = multiaddr.Multiaddr(listen)
    host = new_host(key_pair=create_new_key_pair(), listen_addrs=[addr])
    kad = KadDHT(host, DHTMode.SERVER)
    relay = CircuitV2Protocol(
        host,
        limits=RelayLimits(duration=3600, data=1 << 30, max_circuit_conns=16, max_reservations=64,
                           reservation_ttl=3600),
        allow_hop=True,
    )
    async with host.run([addr]), background_trio_service(kad), background_trio_service(relay):
        await relay.event_started.wait()
        yield StandardNode(host, kad)


async def _serve(listen: str) -> None:
    async with standard_node(listen) as node:
        print(json.dumps({"event": "up", "peer_id": node.peer_id,
                          "addrs": [str(a) for a in node.host.get_addrs()]}), flush=True)
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if command.get("cmd") == "peer":
                print(json.dumps({"event": "peer", **node.describe(command["id"])}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    trio.run(_serve, parser.parse_args().listen)


if __name__ == "__main__":
    main()
