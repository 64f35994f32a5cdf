"""Hostile input to a real DHT node: rejected, counted, logged once, peer dropped, no crash."""

from __future__ import annotations

import logging
import time

import pytest
import trio
from dht_cluster import connect, running_hosts
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message

from lattica.dht import DHTConfig, LatticaDHT, content_key
from lattica.dht.records import ExpiringRecord, encode_record
from lattica.dht.screen import encode_varint
from lattica.errors import LocalProtocolError

CONFIG = DHTConfig(max_value_bytes=1024, max_message_bytes=8 * 1024, query_timeout=5.0)


def _frame(msg: Message) -> bytes:
    body = msg.SerializeToString()
    return encode_varint(len(body)) + body


def _put_value(key: str, value: bytes) -> bytes:
    msg = Message()
    msg.type = Message.MessageType.PUT_VALUE
    msg.key = key.encode()
    msg.record.key = key.encode()
    msg.record.value = value
    return _frame(msg)


def _record(value: bytes, *, ttl: float = 60.0) -> bytes:
    return encode_record(ExpiringRecord(value=value, seq=1, expires_at=time.time() + ttl))


async def _send_raw(attacker, victim, payload: bytes) -> None:
    """Write ``payload`` on a fresh DHT stream and read until the victim gives up on it."""
    try:
        stream = await attacker.new_stream(victim.get_id(), [PROTOCOL_ID])
        await stream.write(payload)
        with trio.move_on_after(5):
            while await stream.read(4096):
                pass
    except Exception:  # noqa: BLE001 - a reset stream is the expected answer; libp2p raises many kinds
        pass  # a reset stream is the expected answer


async def _still_serves(victim_dht, victim, helper) -> None:
    """A well-behaved peer still gets answers from the victim."""
    helper_dht = LatticaDHT(helper, config=CONFIG)
    await connect(helper, victim)
    await helper_dht.bootstrap()
    key = content_key(b"still-alive")
    assert await victim_dht.provide(key)
    found = await helper_dht.find_providers(key)
    assert [p.peer_id for p in found.providers] == [victim.get_id()]


PAYLOADS = {
    "garbage": b"\x05hello" + bytes(range(256)),
    "bad-varint": b"\xff" * 12,
    "oversize-prefix": encode_varint(10 * 1024 * 1024) + b"\x00" * 64,
    "unknown-namespace": _put_value("/evil/key", _record(b"x")),
    "oversize-value": _put_value("/lattica/run/r1", _record(b"x" * 4096)),
    "expired-record": _put_value("/lattica/run/r1", _record(b"x", ttl=-5)),
    "not-an-envelope": _put_value("/lattica/run/r1", b"plain bytes"),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
async def test_bad_frame_is_rejected_and_peer_dropped(payload, caplog):
    caplog.set_level(logging.WARNING, logger="lattica.dht")
    async with running_hosts(3) as (victim, attacker, helper):
        victim_dht = LatticaDHT(victim, config=CONFIG)
        await connect(attacker, victim)
        with trio.fail_after(15):
            await _send_raw(attacker, victim, payload)
            while victim_dht.rejected_inputs == 0:
                await trio.sleep(0.05)
        assert victim_dht.rejected_inputs == 1
        assert not victim_dht.kad.value_store.store  # nothing was stored
        assert not victim_dht.kad.routing_table.peer_in_table(attacker.get_id())
        with trio.fail_after(5):
            while attacker.get_id() in victim.get_connected_peers():
                await trio.sleep(0.05)
        drops = [r for r in caplog.records if r.name == "lattica.dht.node"]
        assert len(drops) == 1
        assert str(attacker.get_id()) in drops[0].getMessage()
        await _still_serves(victim_dht, victim, helper)


async def test_flood_from_one_peer_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="lattica.dht")
    async with running_hosts(2) as (victim, attacker):
        victim_dht = LatticaDHT(victim, config=CONFIG)
        with trio.fail_after(20):
            for _ in range(3):
                await connect(attacker, victim)
                await _send_raw(attacker, victim, PAYLOADS["garbage"])
        assert victim_dht.rejected_inputs >= 1
        assert len([r for r in caplog.records if r.name == "lattica.dht.node"]) == 1


async def test_valid_records_round_trip_and_bad_ones_are_refused_locally():
    async with running_hosts(3) as hosts:
        dhts = [LatticaDHT(h, config=CONFIG) for h in hosts]
        await connect(hosts[1], hosts[0])
        await connect(hosts[2], hosts[1])
        for dht in dhts:
            await dht.bootstrap()
        with trio.fail_after(15):
            await dhts[0].put_record("/lattica/ckpt/r1", b"shard-manifest-v1")
            assert await dhts[2].get_record("/lattica/ckpt/r1") == b"shard-manifest-v1"
            await dhts[0].put_record("/lattica/ckpt/r1", b"shard-manifest-v2")
            dhts[2].kad.value_store.remove(b"/lattica/ckpt/r1")
            assert await dhts[2].get_record("/lattica/ckpt/r1") == b"shard-manifest-v2"
            await dhts[0].republish_records()
        assert all(d.rejected_inputs == 0 for d in dhts)
        with pytest.raises(LocalProtocolError):
            await dhts[0].put_record("/lattica/ckpt/big", b"x" * 2048)
        with pytest.raises(LocalProtocolError):
            await dhts[0].put_record("/other/ckpt", b"x")
        with pytest.raises(LocalProtocolError):
            await dhts[0].put_record("/lattica/secret/x", b"x")
