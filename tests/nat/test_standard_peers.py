"""NAT'd Lattica daemons and a standard libp2p node (relay + DHT server, no Lattica protocol).

Real namespaces with real NAT (``lattica_lab.netlab``); the public node is py-libp2p's
own host, relay v2 and Kademlia server (``tests/net/standard_node.py``), as a relay or DHT
server run by someone else would be. The daemons are ``lattica join`` processes.
"""

from __future__ import annotations

import time

import pytest

from lattica_lab.nat_daemons import QUIET_ENV, LabDaemon, StandardPeer, log_tail, wait_until
from lattica_lab.netlab import NetLab

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180), pytest.mark.usefixtures("netlab_available")]


def _relay_addr(daemon: LabDaemon, relay_id: str) -> str | None:
    addrs = daemon.status().get("relay_addrs") or []
    return next((a for a in addrs if f"/p2p/{relay_id}/p2p-circuit/" in a), None)


def test_a_natd_node_is_joined_through_its_circuit_address_on_a_standard_relay(tmp_path):
    with NetLab() as lab:
        relay = StandardPeer(lab, lab.add_public("s"), tmp_path / "s.log")
        b = LabDaemon(lab, lab.add_private("b", lab.add_nat("nat1")), tmp_path / "b",
                      peers=(relay.addr,), env=QUIET_ENV).wait_up()
        circuit, _ = wait_until(lambda: _relay_addr(b, relay.peer_id), 40)
        assert circuit, log_tail(tmp_path)
        assert circuit.endswith(f"/p2p-circuit/p2p/{b.peer_id}")
        # p is told nothing but the circuit address: no DHT, no peer exchange
        p = LabDaemon(lab, lab.add_public("p"), tmp_path / "p", peers=(circuit,), env=QUIET_ENV)
        p.wait_up(timeout=60)
        entry, _ = wait_until(lambda: p.peer(b.peer_id).get("connected") and p.peer(b.peer_id), 20)
        assert entry, log_tail(tmp_path)
        assert entry["bootstrap"], entry
        assert relay.knows(p.peer_id)["connected"], "p should have gone through the relay"


def test_natd_nodes_find_each_other_through_a_standard_dht_server(tmp_path):
    """b and c know only the standard node. Each finds the other through its DHT — as a
    closer peer in a walk or as a provider of the run key — with a private LAN address and a
    relay address: the DHT's dial must try the relay address (0.3 s after the direct one) and
    its queries must give up on the LAN address after the query timeout (5 s). When the first
    lookup waited for the start-up self-lookup and provide, each losing ~10 s per query on the
    LAN address, they took 34–36 s; the bound leaves room for a loaded machine."""
    with NetLab() as lab:
        server = StandardPeer(lab, lab.add_public("s"), tmp_path / "s.log")
        hb = lab.add_private("b", lab.add_nat("nat1"))
        hc = lab.add_private("c", lab.add_nat("nat2"))
        b = LabDaemon(lab, hb, tmp_path / "b", peers=(server.addr,))
        c = LabDaemon(lab, hc, tmp_path / "c", peers=(server.addr,))
        b.wait_up()
        c.wait_up()
        t0 = time.monotonic()
        entry, waited = wait_until(lambda: b.peer(c.peer_id).get("connected") and b.peer(c.peer_id), 15)
        assert waited is not None, f"b did not reach c within 15 s\n{log_tail(tmp_path)}"
        print(f"b reached c {waited:.1f} s after both were up, path {entry['path']}")
        assert entry["path"] in ("relayed", "hole-punched", "direct"), entry
        # each side registers the connection on its own (c learns of it a moment later)
        back, _ = wait_until(lambda: c.peer(b.peer_id).get("connected"), 30)
        assert back, log_tail(tmp_path)
        # the server hands out their relay addresses (identify, pushed when they change)
        for daemon in (b, c):
            known, _ = wait_until(lambda d=daemon: any(
                "/p2p-circuit" in a for a in server.knows(d.peer_id)["addrs"]), 40)
            assert known, (server.knows(daemon.peer_id), log_tail(tmp_path))
        print(f"b and c connected {time.monotonic() - t0:.1f} s after start")
