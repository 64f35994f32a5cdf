"""Hostile peers against a real TensorService on real libp2p hosts (one process, loopback)."""

from __future__ import annotations

import os
import struct

import multiaddr
import psutil
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.net.host import build_host
from lattica.net.tensors import (
    TENSOR_PROTOCOL,
    TensorLimits,
    TensorService,
    TensorServiceConfig,
    codecs,
    frames,
)

LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
LIMITS = TensorLimits(max_message_bytes=64 << 20, max_total_bytes=128 << 20, max_peer_bytes=96 << 20)


def _put(values, *, tag="t", part=0, dtype="float32", codec="fp32", shape=None) -> bytes:
    spec, payload = codecs.encode(torch.tensor(values, dtype=torch.float32), "fp32", "w")
    wire = ["w", dtype, list(shape if shape is not None else spec.shape), codec]
    return frames._frame({"k": "put", "tag": tag, "part": part, "t": [wire]}) + bytes(payload)


ATTACKS = {
    "garbage": os.urandom(300),
    "lying_header_length": struct.pack(">I", 0xFFFFFFF0) + b"x" * 100,
    "unknown_dtype": _put([1.0], dtype="float8"),
    "unknown_codec": _put([1.0], codec="zstd"),
    "truncated_payload": _put([1.0] * 1000)[:-100],
    "garbage_after_valid": _put([1.0, 2.0]) + b"\x00\x00\x00\x02\xc1\xc1",
    "duplicate_part": _put([1.0]) + _put([2.0]),
    "oversized_then_truncated": frames._frame(
        {"k": "put", "tag": "t", "part": 0, "t": [["w", "float32", [1 << 34], "raw"]]}
    ) + b"\x00" * 4096,
}


async def _host_with_service(nursery, **config):
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    await nursery.start(_run_host, host)
    service = TensorService(host, key_pair, config=TensorServiceConfig(limits=LIMITS, **config))
    await nursery.start(service.run)
    return host, service


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


async def _attack(victim_host, data: bytes):
    attacker = build_host(create_new_key_pair())
    async with attacker.run(LOOPBACK):
        await attacker.connect(info_from_p2p_addr(victim_host.get_addrs()[0]))
        stream = await attacker.new_stream(victim_host.get_id(), [TProtocol(TENSOR_PROTOCOL)])
        try:
            await stream.write(data)
            await stream.close()
        except Exception:
            pass  # the victim may reset us first
        with trio.move_on_after(5):
            while attacker.get_network().get_connections(victim_host.get_id()):
                await trio.sleep(0.05)
        return str(attacker.get_id()), bool(attacker.get_network().get_connections(victim_host.get_id()))


async def test_hostile_frames_drop_the_peer_and_leave_the_node_healthy():
    rss_before = psutil.Process().memory_info().rss
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            victim_host, victim = await _host_with_service(nursery)
            for name, data in ATTACKS.items():
                attacker_id, still_connected = await _attack(victim_host, data)
                assert victim.stats.protocol_errors[attacker_id] == 1, name
                assert not still_connected, name
                assert not victim.is_alive(attacker_id), name
                assert victim.budget.total == 0, name
                assert len(victim.mailbox) == 0, name
            assert victim.stats.refused  # the 64 GiB announcement was refused, not allocated
            # Healthy: an honest peer still exchanges tensors with the victim.
            good_host, good = await _host_with_service(nursery)
            await good_host.connect(info_from_p2p_addr(victim_host.get_addrs()[0]))
            x, y = torch.randn(1000), torch.randn(3, 3)
            async with trio.open_nursery() as pair:
                results = {}

                async def swap(svc, peer, t):
                    results[svc.peer_id] = await svc.exchange([t], peer=peer, tag="after")

                pair.start_soon(swap, victim, good.peer_id, x)
                pair.start_soon(swap, good, victim.peer_id, y)
            assert torch.equal(results[victim.peer_id][0], y)
            assert torch.equal(results[good.peer_id][0], x)
            nursery.cancel_scope.cancel()
    assert psutil.Process().memory_info().rss - rss_before < 200 << 20


async def test_fast_path_rejects_unknown_sessions_and_forged_frames():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            host, service = await _host_with_service(nursery)
            # A connection with an unknown session id is closed without being bound to a peer.
            stream = await trio.open_tcp_stream("127.0.0.1", service.fast_port)
            await stream.send_all(os.urandom(16) + b"\x00\x00\x00\x20" + os.urandom(32))
            with trio.fail_after(5):
                try:
                    assert await stream.receive_some(10) == b""
                except trio.BrokenResourceError:
                    pass  # closed with unread data: a reset
            assert not any(service._channels.values())
            # A properly keyed channel whose frame fails authentication drops the peer.
            forger_host, forger = await _host_with_service(nursery)
            await forger_host.connect(info_from_p2p_addr(host.get_addrs()[0]))
            channel = await forger._dial_fast(service.peer_id)
            with trio.fail_after(5):
                while not service._channels.get(forger.peer_id):
                    await trio.sleep(0.01)
            channel._send_counter += 1  # the next frame is sealed under an unexpected nonce
            await channel.send_all(_put([1.0]))
            with trio.fail_after(5):
                while not service.stats.protocol_errors[forger.peer_id]:
                    await trio.sleep(0.01)
            assert not service.is_alive(forger.peer_id)
            channel.close()
            nursery.cancel_scope.cancel()


async def test_fetch_serves_named_tensors_bit_exactly_and_reports_missing():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            owner_host, owner = await _host_with_service(nursery)
            _, reader = await _host_with_service(nursery, fast_path=False)
            await reader._host.connect(info_from_p2p_addr(owner_host.get_addrs()[0]))
            weights = {"emb": torch.randn(17, 5).to(torch.bfloat16), "step": torch.tensor(41)}
            for name, t in weights.items():
                owner.serve(name, t)
            got = await reader.fetch(owner.peer_id, ["emb", "step"])
            assert torch.equal(got["emb"], weights["emb"])
            assert got["step"].item() == 41
            with pytest.raises(Exception, match="does not serve"):
                await reader.fetch(owner.peer_id, ["absent"])
            assert ID.from_base58(owner.peer_id) == owner_host.get_id()
            nursery.cancel_scope.cancel()
