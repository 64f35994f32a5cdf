"""A frame trickling in over a slow link wakes its receiver a few times, not once per packet.

On a rate-limited link (20 Mbit/s) a frame arrives a packet at a time. Each wake-up of the
receiving event loop takes the interpreter lock from the training thread, so the fast channel
asks the kernel (SO_RCVLOWAT) to wake it only when the rest of the frame, or ``WAKE_BYTES`` of
it, has arrived. Real TCP over loopback; the sender writes the sealed frame in small pieces
with pauses, as a shaped link delivers it.
"""

from __future__ import annotations

import socket

import trio

from lattica.net.tensors import fastpath
from lattica.net.tensors.fastpath import FastChannel

KEY_A, KEY_B = bytes(32), bytes(range(32))
FRAME = 128 << 10
PIECE = 4 << 10


class _Trickle:
    """A real trio TCP socket that sends at most ``PIECE`` bytes per call, with a pause."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock

    async def send(self, data) -> int:
        await trio.sleep(0.002)
        return await self._sock.send(memoryview(data)[:PIECE])

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _CountingReceiver:
    """A real trio TCP socket that counts the receive calls that returned data."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        self.receives = 0

    async def recv_into(self, view, nbytes: int) -> int:
        n = await self._sock.recv_into(view, nbytes)
        self.receives += 1
        return n

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


async def _tcp_pair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await client.connect(listener.getsockname())
    server, _ = await listener.accept()
    listener.close()
    return client, server


async def test_a_trickling_frame_wakes_the_receiver_a_few_times_not_once_per_piece() -> None:
    client, server = await _tcp_pair()
    counting = _CountingReceiver(server)
    sender = FastChannel(_Trickle(client), send_key=KEY_A, recv_key=KEY_B, peer_id="r", frame_bytes=FRAME)  # type: ignore[arg-type]
    receiver = FastChannel(counting, send_key=KEY_B, recv_key=KEY_A, peer_id="s", frame_bytes=FRAME)  # type: ignore[arg-type]
    payload = bytes(range(256)) * (FRAME // 256)
    got = bytearray()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send_all, payload)
            while len(got) < len(payload):
                got += await receiver.receive_some()
    assert bytes(got) == payload
    pieces = (FRAME + 20) // PIECE  # ~33 pieces, each a separate arrival
    assert pieces > 30
    # the length prefix, then the frame in at most a few reads (an early partial read, the rest)
    assert counting.receives <= 6, f"{counting.receives} receive calls for {pieces} arrivals"
    assert FRAME + 16 <= fastpath.WAKE_BYTES or counting.receives >= 2
    sender.close()
    receiver.close()


async def test_the_wake_threshold_never_exceeds_what_the_frame_still_needs() -> None:
    # a 5-byte frame after a 128 KiB one: the receiver must not wait for more than is coming
    client, server = await _tcp_pair()
    sender = FastChannel(client, send_key=KEY_A, recv_key=KEY_B, peer_id="r", frame_bytes=FRAME)
    receiver = FastChannel(server, send_key=KEY_B, recv_key=KEY_A, peer_id="s", frame_bytes=FRAME)
    with trio.fail_after(10):
        await sender.send_all(bytes(FRAME))
        assert len(await receiver.receive_some()) == FRAME
        await sender.send_all(b"hello")
        assert bytes(await receiver.receive_some()) == b"hello"
        sender.close()
        assert len(await receiver.receive_some()) == 0  # a clean end still wakes it
    receiver.close()


async def test_a_large_frame_wakes_the_receiver_once_it_is_whole_not_every_256_kib() -> None:
    # 4 MiB (the default frame) written in 64 KiB pieces: each wake-up is a trip through the
    # event loop, so the receiver reads the frame in a few calls, not one per 256 KiB
    big_frame, piece = 4 << 20, 64 << 10
    client, server = await _tcp_pair()
    counting = _CountingReceiver(server)
    receiver = FastChannel(counting, send_key=KEY_B, recv_key=KEY_A, peer_id="s", frame_bytes=big_frame)  # type: ignore[arg-type]
    sealed = bytearray()

    class _Capture:  # seals the frame as a sender would, to be written in pieces below
        async def send(self, data) -> int:
            sealed.extend(data)
            return len(data)

        def setsockopt(self, *args: object) -> None:
            pass

    capture = FastChannel(_Capture(), send_key=KEY_A, recv_key=KEY_B, peer_id="r", frame_bytes=big_frame)  # type: ignore[arg-type]
    payload = bytes(range(256)) * (big_frame // 256)
    await capture.send_all(payload)

    async def write_in_pieces() -> None:
        for start in range(0, len(sealed), piece):
            await client.send(sealed[start : start + piece])
            await trio.sleep(0.001)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_in_pieces)
            got = bytes(await receiver.receive_some())
    assert got == payload
    assert counting.receives <= 6, f"{counting.receives} receive calls for a 4 MiB frame"
    client.close()
    receiver.close()
