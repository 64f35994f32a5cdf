"""A relayed dial between real hosts on loopback: the Dialer's path and both sides' relay id."""

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from lattica.net.host import build_host
from lattica.net.nat import Dialer, PathBook, RelayReservations, RelayServer
from lattica.net.nat.addresses import relay_of
from lattica.net.nat.paths import Path

pytestmark = pytest.mark.timeout(60)

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def _relayed_conn(host, peer):
    conns = host.get_network().connections.get(peer) or []
    return next(c for c in conns if "p2p-circuit" in str(c.get_transport_addresses()))


async def test_dial_through_relay_names_the_relay_on_both_sides():
    relay, dialer_host, target = (build_host(create_new_key_pair(), listen_addrs=[LOOPBACK]) for _ in range(3))
    relay_server = RelayServer(relay, serve=True)
    target_relay = RelayServer(target, serve=False)
    dialer_relay = RelayServer(dialer_host, serve=False)
    paths = PathBook(dialer_host)
    dialer = Dialer(dialer_host, relay=dialer_relay, paths=paths, holepuncher=None)
    async with (
        relay.run([LOOPBACK]), dialer_host.run([LOOPBACK]), target.run([LOOPBACK]),
        trio.open_nursery() as nursery,
    ):
        for service in (relay_server, target_relay, dialer_relay, paths, dialer):
            await nursery.start(service.run)
        reservations = RelayReservations(target, relays=[PeerInfo(relay.get_id(), relay.get_addrs())], want=1)
        await nursery.start(reservations.run)
        with trio.fail_after(10):
            while not reservations.relay_addrs():
                await trio.sleep(0.05)
        circuit = reservations.relay_addrs()[0]
        with trio.fail_after(15):
            result = await dialer.connect(target.get_id(), [circuit])
        assert result.path is Path.RELAYED
        assert paths.path(target.get_id()) is Path.RELAYED
        # a second connect to a connected peer does not dial again
        again = await dialer.connect(target.get_id(), [circuit])
        assert again.path is Path.RELAYED
        assert len(dialer_host.get_network().connections.get(target.get_id())) == 1
        relay_id = relay.get_id().to_base58()
        on_dialer = _relayed_conn(dialer_host, target.get_id())
        assert relay_of(on_dialer, dialer_host.get_id().to_base58()) == relay_id
        with trio.fail_after(5):
            while not target.get_network().connections.get(dialer_host.get_id()):
                await trio.sleep(0.05)
        on_target = _relayed_conn(target, dialer_host.get_id())
        # py-libp2p names the target itself as the relay here; relay_of looks underneath
        assert target.get_id().to_base58() in str(on_target.get_transport_addresses()[0]).split("/p2p-circuit")[0]
        assert relay_of(on_target, target.get_id().to_base58()) == relay_id
        nursery.cancel_scope.cancel()
