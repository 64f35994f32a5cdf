"""A standalone reachability probe: what ``lattica doctor --peer ...`` learns before joining.

A short-lived libp2p host (this node's identity, its configured listen and announce
addresses) dials each given bootstrap peer (a relay address through its relay, as ``lattica
join`` does), keeps the reason of every failure, lets identify
tell it where the peers see it, asks the reached peers to dial it back (AutoNAT) and to tell
their time. Nothing joins the run: no state, no training, no relay reservations; the host is
closed when the probe returns. The result is a ``NodeFacts``, read by the same checks as a
running daemon's.
"""

from __future__ import annotations

from collections.abc import Sequence

import multiaddr
import trio
from libp2p.crypto.keys import KeyPair

from lattica.diagnostics import NodeFacts, PeerFacts
from lattica.net.addrs import peer_info_from_addr
from lattica.net.clock import measure_clocks
from lattica.net.dialing import short_reason
from lattica.net.host import build_host, stop_auto_connector
from lattica.net.nat.addresses import is_circuit
from lattica.net.nat.autonat import ReachabilityService
from lattica.net.nat.circuit import dial_circuit
from lattica.net.nat.observations import observations

_DIAL_TIMEOUT_S = 10.0
_IDENTIFY_WAIT_S = 1.5
_AUTONAT_BUDGET_S = 8.0


async def probe(
    key_pair: KeyPair, *, listen: Sequence[str], announce: Sequence[str], peers: Sequence[str]
) -> NodeFacts:
    listen_addrs = [multiaddr.Multiaddr(a) for a in listen]
    host = build_host(key_pair, listen_addrs=listen_addrs,
                      announce_addrs=[multiaddr.Multiaddr(a) for a in announce])
    failures: dict[str, str] = {}
    reached: list[str] = []
    async with host.run(listen_addrs):
        await stop_auto_connector(host)

        async def dial(addr: str) -> None:
            try:
                info = peer_info_from_addr(addr)
                with trio.fail_after(_DIAL_TIMEOUT_S):
                    if is_circuit(addr):  # through the relay it names, to the peer behind it
                        await dial_circuit(host, info.addrs[0])
                    else:
                        await host.connect(info)
            except ValueError as exc:
                failures[addr] = str(exc)
            except Exception as exc:  # noqa: BLE001 - every dial failure is a finding
                failures[addr] = short_reason(exc)
            else:
                reached.append(info.peer_id.to_base58())

        async with trio.open_nursery() as nursery:
            for addr in peers:
                nursery.start_soon(dial, addr)
        reachability = ReachabilityService(host)
        if reached:
            await trio.sleep(_IDENTIFY_WAIT_S)  # identify reports where the peers see us
            with trio.move_on_after(_AUTONAT_BUDGET_S):
                await reachability.check()
        clocks = await measure_clocks(host, reached)
        return NodeFacts(
            peer_id=host.get_id().to_base58(),
            listen=tuple(str(a) for a in host.get_transport_addrs()),
            announce=tuple(announce),
            advertised=tuple(str(a) for a in host.get_addrs()),
            reachability=str(reachability.reachability.value),
            dialback=dict(reachability.verdicts),
            observations=tuple(observations(host)),
            peers=tuple(
                PeerFacts(
                    peer_id=peer, connected=True, path="direct",
                    clock_offset_s=clocks[peer].offset_s if peer in clocks else None,
                    clock_error_s=clocks[peer].error_s if peer in clocks else None,
                )
                for peer in reached
            ),
            bootstrap_failures=failures,
            bootstrap_tried=len(peers),
        )
