"""PathBook answers from the swarm's connections as they are when asked, not as last sampled."""

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from lattica.net.nat.paths import Path, PathBook

RELAY = create_new_key_pair().public_key
PEER = ID.from_pubkey(create_new_key_pair().public_key)
CIRCUIT = Multiaddr(f"/p2p/{ID.from_pubkey(RELAY)}/p2p-circuit/p2p/{PEER}")
DIRECT = Multiaddr("/ip4/198.18.0.3/tcp/4001")


class _Conn:
    def __init__(self, addr: Multiaddr) -> None:
        self._addr = addr

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [self._addr]


class _Network:
    def __init__(self) -> None:
        self.connections: dict[ID, list[_Conn]] = {}


class _Host:
    def __init__(self) -> None:
        self.network = _Network()

    def get_network(self) -> _Network:
        return self.network


def test_path_follows_connections_between_samples():
    host = _Host()
    book = PathBook(host)  # type: ignore[arg-type]  # its sampling loop is never started
    assert book.path(PEER) is None
    host.network.connections[PEER] = [_Conn(CIRCUIT)]
    assert book.path(PEER) is Path.RELAYED
    host.network.connections[PEER].append(_Conn(DIRECT))  # a hole punch just succeeded
    assert book.path(PEER) is Path.HOLE_PUNCHED
    assert [p.path for p in book.peers()] == [Path.HOLE_PUNCHED]
    host.network.connections[PEER].pop()  # the direct connection dropped
    assert book.path(PEER) is Path.RELAYED
    del host.network.connections[PEER]
    assert book.path(PEER) is None
    assert book.peers() == []


def test_punch_before_first_sample_is_hole_punched():
    host = _Host()
    book = PathBook(host)  # type: ignore[arg-type]
    book.note_relayed(PEER)  # the dialer won over the relay; the punch finished before a sample
    host.network.connections[PEER] = [_Conn(CIRCUIT), _Conn(DIRECT)]
    assert book.path(PEER) is Path.HOLE_PUNCHED
