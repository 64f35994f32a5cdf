"""The provider-lookup state machine over an in-memory Kademlia network (sans-IO)."""

from __future__ import annotations

import hashlib
import random

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from lattica.dht.keys import content_key, run_key
from lattica.dht.lookup import ProviderLookup, keyspace_distance


def _ids(n: int) -> list[ID]:
    return [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(n)]


PEERS = _ids(60)


class FakeNetwork:
    """Each peer knows a random 8 others plus its 4 keyspace neighbours; holders know providers."""

    def __init__(self, key: bytes, providers: dict[ID, list[PeerInfo]], *, dead=()):
        rng = random.Random(7)
        self.key = key
        self.providers = providers
        self.dead = set(dead)
        self.known = {p: rng.sample([q for q in PEERS if q != p], 8) for p in PEERS}

    def answer(self, peer: ID):
        key_hash = int.from_bytes(hashlib.sha256(self.key).digest(), "big")
        closer = sorted(self.known[peer], key=lambda q: keyspace_distance(key_hash, q))[:5]
        return self.providers.get(peer, []), closer


def _run(lookup: ProviderLookup, net: FakeNetwork, *, max_steps=500) -> None:
    steps = 0
    while not lookup.done:
        batch = lookup.next_queries()
        assert batch, "not done, yet nothing to query"
        for peer in batch:
            if peer in net.dead:
                lookup.on_failure(peer)
            else:
                providers, closer = net.answer(peer)
                lookup.on_response(peer, providers=providers, closer=closer)
        steps += 1
        assert steps < max_steps


def _info(peer: ID, port: int) -> PeerInfo:
    return PeerInfo(peer, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")])


def test_finds_all_providers_and_deduplicates_them():
    key = content_key(b"shard")
    key_hash = int.from_bytes(hashlib.sha256(key).digest(), "big")
    holders = sorted(PEERS, key=lambda p: keyspace_distance(key_hash, p))[:3]
    a, b = PEERS[-1], PEERS[-2]
    # Every close holder stores both providers; b is announced with two addresses.
    net = FakeNetwork(key, {h: [_info(a, 1), _info(b, 2), _info(b, 3)] for h in holders})
    lookup = ProviderLookup(key, PEERS[:3], local_id=PEERS[10], width=20, parallelism=3)
    _run(lookup, net)
    found = {info.peer_id: info for info in lookup.providers}
    assert set(found) == {a, b}
    assert len(lookup.providers) == 2
    assert len(found[b].addrs) == 2
    assert lookup.first_provider_hop is not None
    assert lookup.first_provider_hop >= 1


def test_dead_peers_do_not_stall_the_walk():
    key = run_key("r")
    net = FakeNetwork(key, {}, dead=PEERS[:30])
    lookup = ProviderLookup(key, PEERS[:5], local_id=PEERS[59], width=10, parallelism=3)
    _run(lookup, net)
    assert lookup.providers == []
    assert lookup.first_provider_hop is None


def test_stops_early_when_enough_providers_are_known():
    key = run_key("r")
    net = FakeNetwork(key, {p: [_info(p, 9)] for p in PEERS})
    lookup = ProviderLookup(key, PEERS[:3], local_id=PEERS[59], parallelism=1, enough=2)
    _run(lookup, net)
    assert len(lookup.providers) == 2
    assert lookup.queries == 2


def test_never_queries_itself_and_respects_parallelism():
    me = PEERS[0]
    lookup = ProviderLookup(run_key("r"), PEERS[:6], local_id=me, parallelism=2)
    first = lookup.next_queries()
    assert len(first) == 2
    assert me not in first
    assert lookup.next_queries() == []  # window full until an answer arrives


def test_no_seeds_means_done_at_once():
    lookup = ProviderLookup(run_key("r"), [], local_id=PEERS[0])
    assert lookup.done


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 129, "../etc"])
def test_run_ids_are_validated(bad):
    with pytest.raises(ValueError, match="run id"):
        run_key(bad)
