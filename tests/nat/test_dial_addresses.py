"""Which addresses the daemon keeps, passes on and dials for a peer (pure, no network)."""

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from lattica.net.dialing import dial_addrs_for
from lattica.net.peer_exchange import MAX_ADDRS, px_reply
from lattica.net.peerbook import MAX_CIRCUITS_PER_PEER, PeerBook
from lattica.node.nat_service import advertised_addrs


def _pid() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


PEER, RELAY1, RELAY2, OTHER = _pid(), _pid(), _pid(), _pid()
DIRECT = f"/ip4/198.19.1.2/tcp/4001/p2p/{PEER}"
VIA1 = f"/ip4/198.18.0.1/tcp/4001/p2p/{RELAY1}/p2p-circuit/p2p/{PEER}"
VIA2 = f"/ip4/198.18.0.2/tcp/4001/p2p/{RELAY2}/p2p-circuit/p2p/{PEER}"


def test_relay_addresses_are_replaced_direct_ones_accumulate():
    book = PeerBook(_pid())
    book.learn(PEER, [DIRECT, VIA1], now=1.0)
    record = book.learn(PEER, [VIA2], now=2.0)  # relay 1 went away, the peer moved to relay 2
    assert record is not None
    assert record.addrs == [DIRECT, VIA2]
    record = book.learn(PEER, [f"/ip4/198.18.0.9/tcp/4001/p2p/{PEER}"], now=3.0)
    assert record.addrs == [DIRECT, f"/ip4/198.18.0.9/tcp/4001/p2p/{PEER}", VIA2]
    many = [f"/ip4/198.18.0.{i}/tcp/4001/p2p/{_pid()}/p2p-circuit/p2p/{PEER}" for i in range(10)]
    record = book.learn(PEER, many, now=4.0)
    assert [a for a in record.addrs if "p2p-circuit" in a] == many[:MAX_CIRCUITS_PER_PEER]


def test_direct_addresses_cannot_crowd_out_relay_addresses():
    book = PeerBook(_pid())
    book.learn(PEER, [VIA1], now=1.0)
    record = book.learn(PEER, [f"/ip4/10.0.0.{i}/tcp/4001" for i in range(40)], now=2.0)
    assert record is not None
    assert VIA1 in record.addrs
    reply = px_reply([(PEER, list(record.addrs))])
    sent = reply["peers"][0]["addrs"]
    assert len(sent) == MAX_ADDRS
    assert VIA1 in sent


def test_dial_addrs_keep_only_relay_addresses_that_end_in_the_peer():
    forged = f"/ip4/198.18.0.1/tcp/4001/p2p/{RELAY1}/p2p-circuit/p2p/{OTHER}"
    someone_else = f"/ip4/198.18.0.7/tcp/4001/p2p/{OTHER}"
    addrs = [DIRECT, VIA1, forged, someone_else, "/ip4/not-an-ip/tcp/1", "garbage"]
    got = [str(a) for a in dial_addrs_for(PEER, addrs, relayed=True)]
    assert got == ["/ip4/198.19.1.2/tcp/4001", VIA1]
    # without a path dialer (NAT services off) relay addresses are not dialable at all
    assert [str(a) for a in dial_addrs_for(PEER, addrs, relayed=False)] == ["/ip4/198.19.1.2/tcp/4001"]


def test_member_record_addresses_are_checked():
    record = {"addrs": [DIRECT, VIA1, f"/ip4/198.18.0.1/tcp/4001/p2p/{OTHER}", 7, "x" * 600,
                        f"/p2p/{RELAY1}/p2p-circuit/p2p/{OTHER}/p2p/{PEER}"]}
    assert advertised_addrs(PEER, record) == [DIRECT, VIA1]
    assert advertised_addrs(PEER, {"addrs": "not a list"}) == []
    assert advertised_addrs(PEER, None) == []
