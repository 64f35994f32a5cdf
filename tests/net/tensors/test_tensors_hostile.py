"""Hostile peers against a real TensorService on real libp2p hosts (one process, loopback)."""

from __future__ import annotations

import contextlib
import os
import struct
from functools import partial

import multiaddr
import psutil
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.errors import PeerUnavailableError
from lattica.net.host import build_host
from lattica.net.tensors import (
    TENSOR_PROTOCOL,
    TensorLimits,
    TensorService,
    TensorServiceConfig,
    fastpath,
    frames,
)
from lattica.net.tensors.limits import FetchAnswer, FetchGate
from lattica.net.wire import read_message, write_message
from lattica.numerics import codecs

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
    config.setdefault("limits", LIMITS)
    service = TensorService(host, key_pair, config=TensorServiceConfig(**config))
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
        except Exception:  # noqa: BLE001 - the victim may reset us first; libp2p raises many kinds
            pass
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
                with contextlib.suppress(trio.BrokenResourceError):  # closed with unread data: a reset
                    assert await stream.receive_some(10) == b""
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


async def _owner_and_member(nursery, *, limits: TensorLimits = LIMITS, member_fast_path: bool = True):
    """A node serving a 1 MiB tensor under "w", and a member connected to it."""
    owner_host, owner = await _host_with_service(nursery, limits=limits)
    member_host, member = await _host_with_service(nursery, fast_path=member_fast_path)
    await member_host.connect(info_from_p2p_addr(owner_host.get_addrs()[0]))
    owner.serve("w", torch.arange(1 << 18, dtype=torch.float32))  # 1 MiB
    return owner, member


async def _fetch_many(member, owner, names, count: int) -> tuple[int, int]:
    """``count`` concurrent fetches; returns (answered with the tensors, refused)."""
    outcome = {"served": 0, "refused": 0, "failed": 0}

    async def one() -> None:
        with trio.move_on_after(5):  # a dropped request is never answered
            try:
                await member.fetch(owner.peer_id, names)
            except PeerUnavailableError as exc:
                outcome["refused" if "does not serve" in str(exc) else "failed"] += 1
            else:
                outcome["served"] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    assert not outcome["failed"]
    return outcome["served"], outcome["refused"]


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_fetch_flood_makes_the_owner_send_only_a_few_copies(fast_path):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            owner, member = await _owner_and_member(nursery, member_fast_path=fast_path)
            served, refused = await _fetch_many(member, owner, ["w"], 50)
            assert 1 <= served <= LIMITS.max_peer_fetch_serves
            assert refused >= 1
            # 50 requests of a few bytes each: at most two 1 MiB copies went out, not 50
            assert owner.stats.sent_to(member.peer_id) < (LIMITS.max_peer_fetch_serves + 1) << 20
            assert owner.fetch_gate.refused[member.peer_id] >= 48 - served
            assert not owner.fetch_gate.serving
            assert not owner.fetch_gate.refusing
            nursery.cancel_scope.cancel()


async def test_a_fetch_naming_a_tensor_many_times_gets_it_once():
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            owner, member = await _owner_and_member(nursery)
            got = await member.fetch(owner.peer_id, ["w"] * 200)
            assert torch.equal(got["w"], torch.arange(1 << 18, dtype=torch.float32))
            assert owner.stats.sent_to(member.peer_id) < 2 << 20
            nursery.cancel_scope.cancel()


async def test_the_same_content_is_sent_to_a_peer_again_only_after_the_repeat_interval():
    limits = TensorLimits(
        max_message_bytes=64 << 20, max_total_bytes=128 << 20, max_peer_bytes=96 << 20, fetch_repeat_s=2.0
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            owner, member = await _owner_and_member(nursery, limits=limits)
            await member.fetch(owner.peer_id, ["w"])
            with pytest.raises(Exception, match="does not serve"):
                await member.fetch(owner.peer_id, ["w"])  # at once: refused
            owner.serve("w", torch.zeros(4))  # new content under the same name: served
            assert torch.equal((await member.fetch(owner.peer_id, ["w"]))["w"], torch.zeros(4))
            with pytest.raises(Exception, match="does not serve"):
                await member.fetch(owner.peer_id, ["w"])
            await trio.sleep(2.1)
            assert torch.equal((await member.fetch(owner.peer_id, ["w"]))["w"], torch.zeros(4))
            nursery.cancel_scope.cancel()


async def test_the_fast_path_is_dialed_only_at_the_address_the_peer_connects_from():
    """A member's fast-path setup reply names another host (a victim listening on 127.0.0.2):
    the node dials the member's own address instead, fails, and uses libp2p streams."""
    victim_hits = []

    async def victim(stream):
        victim_hits.append(stream)
        await stream.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, victim, 0, host="127.0.0.2"))
            victim_port = listeners[0].socket.getsockname()[1]
            node_host, node = await _host_with_service(nursery)
            liar_host, liar = await _host_with_service(nursery)
            await node_host.connect(info_from_p2p_addr(liar_host.get_addrs()[0]))

            async def lying_setup(stream):
                await read_message(stream, max_size=4096)
                reply = {"port": victim_port, "nonce": os.urandom(32), "sid": os.urandom(16), "host": "127.0.0.2"}
                await write_message(stream, reply)
                await stream.close()

            liar_host.set_stream_handler(TProtocol(fastpath.FAST_PROTOCOL), lying_setup)
            await node.send(liar.peer_id, "t", [torch.ones(8)])
            got = await liar.receive(node.peer_id, "t")  # delivered over a libp2p stream
            assert torch.equal(got[0][1], torch.ones(8))
            assert node.stats.bytes_sent[(liar.peer_id, "libp2p")] > 0
            await trio.sleep(0.2)
            assert victim_hits == []
            nursery.cancel_scope.cancel()


def test_the_fetch_gate_rations_answers_per_peer():
    gate = FetchGate(TensorLimits(max_peer_fetch_serves=2, max_fetch_serves=4, fetch_repeat_s=5.0))
    a, b, c = ("w", 1), ("w", 2), ("w", 3)
    assert gate.request("p", (a,), 0.0) is FetchAnswer.SERVE
    for _ in range(4):
        assert gate.request("p", (a,), 0.1) is FetchAnswer.REFUSE  # the same content again
    assert gate.request("p", (a,), 0.2) is FetchAnswer.DROP  # while four refusals are on their way
    assert gate.request("p", (b,), 0.3) is FetchAnswer.SERVE
    for _ in range(4):
        gate.done("p", FetchAnswer.REFUSE, (a,), 0.4)
    assert gate.request("p", (c,), 0.5) is FetchAnswer.REFUSE  # two in flight already
    gate.done("p", FetchAnswer.REFUSE, (c,), 0.5)
    assert gate.request("q", (a,), 0.5) is FetchAnswer.SERVE  # another peer has its own share
    gate.done("p", FetchAnswer.SERVE, (a,), 1.0)
    assert gate.request("p", (a,), 5.9) is FetchAnswer.REFUSE  # 5 s from the end of the send
    gate.done("p", FetchAnswer.REFUSE, (a,), 5.9)
    assert gate.request("p", (a,), 6.1) is FetchAnswer.SERVE
    assert gate.request("p", (), 6.2) is FetchAnswer.REFUSE  # nothing served: a cheap answer
    gate.done("p", FetchAnswer.REFUSE, (), 6.2)
    assert gate.refused["p"] == 7  # the empty request is not held against it
    gate.request("z", (a,), 7.0)
    assert set(gate._recent) == {"p", "z"}  # "q" was sent to 6.5 s ago: forgotten
    gate.request("z", (b,), 20.0)  # long after: what was sent to others is forgotten
    assert list(gate._recent) == ["z"]


async def test_a_send_queued_behind_one_that_broke_the_channel_goes_out_on_a_new_one():
    """A send waits for the channel while another is in flight; the one in flight is cancelled
    and aborts the channel (a phase or round deadline). Nothing of the queued message had left,
    so it goes out on a fresh channel instead of failing the peer as unavailable."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a_host, a = await _host_with_service(nursery)
            b_host, b = await _host_with_service(nursery)
            await a_host.connect(info_from_p2p_addr(b_host.get_addrs()[0]))
            await a.send(b.peer_id, "first", [torch.ones(4)])
            assert next(t for _, t in await b.receive(a.peer_id, "first")).tolist() == [1.0] * 4
            (channel,) = a._open_channels(b.peer_id)
            sent: list[str] = []

            async def queued() -> None:
                await a.send(b.peer_id, "second", [torch.full((4,), 2.0)])
                sent.append("second")

            async with channel.send_lock:  # a send in flight on the only channel
                nursery.start_soon(queued)
                await trio.sleep(0.2)  # the second send waits for the lock
                channel.abort()  # the send in flight is cancelled: the channel is reset
            got = await b.receive(a.peer_id, "second")
            assert next(t for _, t in got).tolist() == [2.0] * 4
            assert sent == ["second"]
            assert channel.closed
            assert a._open_channels(b.peer_id)  # a new channel
            assert a.stats.bytes_sent[(b.peer_id, "libp2p")] == 0
            nursery.cancel_scope.cancel()
