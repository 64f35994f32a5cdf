"""DHTConfig validation, the penalty box and provider-record expiry (no network)."""

from __future__ import annotations

import time

import pytest
from libp2p.peer.peerinfo import PeerInfo

from lattica.dht import DHTConfig
from lattica.dht.penalties import PenaltyBox
from lattica.dht.provider_store import ExpiringProviderStore


@pytest.mark.parametrize(
    "kwargs",
    [
        {"provider_ttl": 0},
        {"provider_ttl": 10, "reprovide_interval": 10},
        {"record_ttl": 10, "republish_interval": 20},
        {"lookup_parallelism": 0},
        {"min_run_peers": 10, "max_run_peers": 5},
        {"max_value_bytes": 64 * 1024, "max_message_bytes": 64 * 1024},
        {"ban_seconds": -1},
    ],
)
def test_bad_configs_are_refused(kwargs):
    with pytest.raises(ValueError, match="must"):
        DHTConfig(**kwargs)


def test_default_config_is_valid_and_frozen():
    config = DHTConfig()
    with pytest.raises(AttributeError):
        config.provider_ttl = 1  # type: ignore[misc]


def test_penalty_box_reports_first_offence_once_and_bans_for_a_while():
    box = PenaltyBox(ban_seconds=10)
    assert box.reject("p", "garbage", now=0)
    assert not box.reject("p", "garbage", now=5)
    assert box.is_banned("p", now=9)
    assert not box.is_banned("p", now=10)
    assert box.reject("p", "garbage", now=11)
    assert box.rejected_inputs == 3
    assert box.banned_peers(now=12) == ["p"]


class _Host:
    def __init__(self, peer_id):
        self._id = peer_id

    def get_id(self):
        return self._id


def test_provider_records_expire_after_ttl_but_own_ones_do_not():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    me, other = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    store = ExpiringProviderStore(host=_Host(me), ttl=5)
    store.add_provider(b"k", PeerInfo(me, []))
    store.add_provider(b"k", PeerInfo(other, []))
    assert {p.peer_id for p in store.get_providers(b"k")} == {me, other}
    store.providers[b"k"][str(other)].timestamp = time.time() - 6
    assert {p.peer_id for p in store.get_providers(b"k")} == {me}
    store.remove_provider(str(me))
    store.cleanup_expired()
    assert store.providers == {}


def test_expired_value_records_are_dropped_from_the_store():
    from libp2p.crypto.ed25519 import create_new_key_pair

    from lattica.dht import LatticaDHT
    from lattica.dht.records import ExpiringRecord, encode_record
    from lattica.net.host import build_host

    dht = LatticaDHT(build_host(create_new_key_pair()), config=DHTConfig())
    live = encode_record(ExpiringRecord(value=b"a", seq=0, expires_at=time.time() + 30))
    dead = encode_record(ExpiringRecord(value=b"b", seq=0, expires_at=time.time() - 1))
    dht.kad.value_store.put(b"/lattica/ckpt/live", live)
    dht.kad.value_store.put(b"/lattica/ckpt/dead", dead)
    dht.expire_records()
    assert set(dht.kad.value_store.store) == {b"/lattica/ckpt/live"}
