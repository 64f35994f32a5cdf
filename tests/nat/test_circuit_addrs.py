"""Relay addresses: parsed with their target id kept, normalized from identify's form, and
advertised to any libp2p peer through identify (pushed when they change)."""

from __future__ import annotations

import sys
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from lattica.net.addrs import peer_info_from_addr
from lattica.net.dialing import dial_addrs_for
from lattica.net.host import AnnouncementWatcher, build_host, circuit_addr_for
from lattica.net.identity import peer_id_of
from lattica.net.nat.circuit import parse_circuit_addr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "net"))
from standard_node import standard_node

pytestmark = pytest.mark.timeout(60)

R = peer_id_of(create_new_key_pair()).to_base58()
X = peer_id_of(create_new_key_pair()).to_base58()
OTHER = peer_id_of(create_new_key_pair()).to_base58()
RELAY = f"/ip4/198.18.0.1/tcp/4001/p2p/{R}"


def test_a_circuit_peer_address_names_its_target_and_keeps_it() -> None:
    info = peer_info_from_addr(f"{RELAY}/p2p-circuit/p2p/{X}")
    assert info.peer_id.to_base58() == X
    assert [str(a) for a in info.addrs] == [f"{RELAY}/p2p-circuit/p2p/{X}"]
    direct = peer_info_from_addr(RELAY)
    assert direct.peer_id.to_base58() == R
    assert [str(a) for a in direct.addrs] == ["/ip4/198.18.0.1/tcp/4001"]


@pytest.mark.parametrize("bad", [
    f"{RELAY}/p2p-circuit",  # no target
    f"/ip4/198.18.0.1/tcp/4001/p2p-circuit/p2p/{X}",  # no relay id
    f"{RELAY}/p2p-circuit/p2p/{R}",  # relay and target the same
    f"{RELAY}/p2p-circuit/p2p/{X}/p2p-circuit/p2p/{OTHER}",  # two hops
    "/ip4/198.18.0.1/tcp/4001",  # names no peer
])
def test_bad_peer_addresses_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message is for the user; the type matters
        peer_info_from_addr(bad)


def test_circuit_addresses_from_identify_get_their_target_appended() -> None:
    assert circuit_addr_for(f"{RELAY}/p2p-circuit", X) == f"{RELAY}/p2p-circuit/p2p/{X}"
    assert circuit_addr_for(f"{RELAY}/p2p-circuit/p2p/{X}", X) == f"{RELAY}/p2p-circuit/p2p/{X}"
    assert circuit_addr_for(f"{RELAY}/p2p-circuit/p2p/{OTHER}", X) is None
    assert circuit_addr_for(RELAY, X) is None
    addrs = dial_addrs_for(X, [f"{RELAY}/p2p-circuit", f"{RELAY}/p2p-circuit/p2p/{OTHER}"], relayed=True)
    assert [str(a) for a in addrs] == [f"{RELAY}/p2p-circuit/p2p/{X}"]
    assert parse_circuit_addr(str(addrs[0])).relay_addr == RELAY


async def test_relay_addresses_reach_a_standard_peer_through_identify_push() -> None:
    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    host = build_host(create_new_key_pair(), listen_addrs=[listen])
    async with standard_node() as peer, host.run([listen]), trio.open_nursery() as nursery:
        await nursery.start(AnnouncementWatcher(host, interval=0.1).run)
        await host.connect(PeerInfo(peer.host.get_id(), peer.host.get_addrs()))
        me = host.get_id().to_base58()
        with trio.fail_after(10):
            while not peer.describe(me)["protocols"]:  # identify on connect
                await trio.sleep(0.05)
        assert not any("p2p-circuit" in a for a in peer.describe(me)["addrs"])
        circuit = f"{peer.addr}/p2p-circuit/p2p/{me}"
        assert host.set_circuit_addrs([circuit])
        assert not host.set_circuit_addrs([circuit])  # unchanged
        assert str(host.get_addrs()[-1]) == circuit
        assert all("p2p-circuit" not in str(a) for a in host.get_addrs()[:-1])
        with trio.fail_after(10):
            while not any("p2p-circuit" in a for a in peer.describe(me)["addrs"]):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
