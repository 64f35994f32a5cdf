"""The fast channel: a direct TCP connection carrying AES-256-GCM frames.

Theory of operation
-------------------
libp2p's Noise+Yamux streams move about a tenth of raw TCP's bytes per second here, so bulk
tensors take a side road whose keys come from the main road:

1. Over an authenticated libp2p stream (``FAST_PROTOCOL``) the initiator sends 32 random bytes;
   the responder answers with its fast-path TCP port, 32 random bytes of its own and a one-time
   16-byte session id, and remembers the pending session for ``PENDING_TTL_S``.
2. Both derive two AES-256-GCM keys with HKDF-SHA256 over both nonces, both peer ids and the
   session id: one per direction. Only the two authenticated peers know the inputs, since they
   crossed a Noise channel.
3. The initiator opens TCP to the responder, sends the session id, then an encrypted ``HELLO``
   frame. The responder pops the session (an id is usable once), and binds the connection to
   the peer id only after the hello decrypts — the AEAD tag proves knowledge of the key.
4. Then each direction is a sequence of frames ``u32 length | ciphertext+tag`` whose nonce is
   the frame counter, so nonces never repeat under a key. A frame that fails authentication,
   or a length over the cap, is a ``RemoteProtocolError``; the connection is dropped.

A frame is useless until all of it has arrived (its tag is checked over the whole), so the
receiver asks the kernel (``SO_RCVLOWAT``) to wake it only once the rest of the frame is there:
on a slow link bytes trickle in packet by packet, and a wake-up per packet would take the
interpreter lock from the training thread hundreds of times a second; on a fast one every
wake-up is a trip through the event loop (a 4 MiB frame woken every 256 KiB cost an
all-reduce peer ~300 of them per 100 MB). The kernel also wakes a reader whose receive buffer
fills up or whose receive window closes, so a frame larger than the buffer cannot stall.

The plaintext is a byte stream carrying ``frames.py`` messages, exactly like a libp2p stream.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lattica.errors import BrokenError, RemoteProtocolError

FAST_PROTOCOL = "/lattica/tensors/fast/1.0.0"
HELLO = b"lattica-fast/1 hello"
SESSION_ID_BYTES = 16
NONCE_BYTES = 32
PENDING_TTL_S = 10.0
_LEN = struct.Struct(">I")
_TAG_BYTES = 16
WAKE_BYTES = 64 << 20  # the most a receiver waits for before it is woken (SO_RCVLOWAT): a whole frame


def derive_keys(
    initiator_nonce: bytes, responder_nonce: bytes, initiator: str, responder: str, sid: bytes
) -> tuple[bytes, bytes]:
    """Return (initiator→responder key, responder→initiator key)."""
    info = b"lattica fast path v1|" + initiator.encode() + b"|" + responder.encode() + b"|" + sid
    hkdf = HKDF(algorithm=hashes.SHA256(), length=64, salt=initiator_nonce + responder_nonce, info=info)
    okm = hkdf.derive(b"lattica-fast-path")
    return okm[:32], okm[32:]


class FastChannel:
    """One authenticated, encrypted, bidirectional byte stream to one peer."""

    def __init__(
        self,
        sock: trio.socket.SocketType,
        *,
        send_key: bytes,
        recv_key: bytes,
        peer_id: str,
        frame_bytes: int,
    ) -> None:
        self.peer_id = peer_id
        self.send_lock = trio.Lock()
        self._sock = sock
        self._send_aead = AESGCM(send_key)
        self._recv_aead = AESGCM(recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        self._frame_bytes = frame_bytes
        self._send_buf = bytearray(_LEN.size + frame_bytes + _TAG_BYTES)
        self._recv_buf = bytearray(frame_bytes + _TAG_BYTES)
        self._plain_buf = bytearray(frame_bytes)
        self._closed = False
        self.bytes_out = 0  # bytes the socket took so far (a send that took none left nothing behind)
        self._wake_at = 1  # the socket's SO_RCVLOWAT (the kernel's default: any byte)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # whole frames per system call
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, frame_bytes + _TAG_BYTES + _LEN.size)

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._frame_bytes):
            await self._send_frame(view[start : start + self._frame_bytes])

    async def _send_frame(self, plaintext: memoryview | bytes) -> None:
        # One reused buffer per direction: fresh multi-megabyte allocations cost page faults
        # that, on a busy host, are slower than the encryption itself.
        n = len(plaintext) + _TAG_BYTES
        _LEN.pack_into(self._send_buf, 0, n)
        out = memoryview(self._send_buf)[_LEN.size : _LEN.size + n]
        self._send_aead.encrypt_into(_nonce(self._send_counter), plaintext, None, out)
        self._send_counter += 1
        await self._send_raw(memoryview(self._send_buf)[: _LEN.size + n])

    async def _send_raw(self, view: memoryview) -> None:
        try:
            while view:
                sent = await self._sock.send(view)
                self.bytes_out += sent
                view = view[sent:]
        except (OSError, trio.ClosedResourceError) as exc:  # closed by another task: broken too
            self._closed = True
            raise BrokenError(f"fast channel broken: {exc!r}", peer_id=self.peer_id) from None

    async def receive_some(self) -> memoryview:
        """The next frame's plaintext; empty when the peer closed cleanly between frames.

        The returned view is only valid until the next call (its buffer is reused).
        """
        data, _ = await self.receive_frame(lambda: None)
        return data

    async def receive_frame(self, into: Callable[[], memoryview | None]) -> tuple[memoryview, bool]:
        """Like ``receive_some``, but decrypts straight into the buffer ``into()`` returns (it
        is asked once the frame has arrived, just before decryption) when the frame fits.

        Returns the plaintext view and whether it is that buffer's first bytes.
        """
        header = await self._receive_or_eof(_LEN.size)
        if header is None:
            return memoryview(b""), False
        (length,) = _LEN.unpack(header)
        if not _TAG_BYTES < length <= self._frame_bytes + _TAG_BYTES:
            raise RemoteProtocolError(f"fast frame of {length} bytes", peer_id=self.peer_id)
        sealed = await self._receive_exactly(length)
        n = length - _TAG_BYTES
        target = into()
        direct = target is not None and n <= len(target)
        out = target[:n] if target is not None and direct else memoryview(self._plain_buf)[:n]
        try:
            self._recv_aead.decrypt_into(_nonce(self._recv_counter), sealed, None, out)
        except InvalidTag:
            raise RemoteProtocolError("fast frame failed authentication", peer_id=self.peer_id) from None
        self._recv_counter += 1
        return out, direct

    async def _receive_exactly(self, n: int) -> memoryview:
        view = await self._receive_or_eof(n)
        if view is None:  # the peer closed where a frame had to continue
            raise BrokenError(f"fast channel ended mid-frame (0/{n})", peer_id=self.peer_id)
        return view

    async def _receive_or_eof(self, n: int) -> memoryview | None:
        """``n`` bytes, or None when the peer closed cleanly before sending any of them."""
        view = memoryview(self._recv_buf)[:n]
        got = 0
        while got < n:
            self._wake_when(min(n - got, WAKE_BYTES))
            try:
                k = await self._sock.recv_into(view[got:], n - got)
            except (OSError, trio.ClosedResourceError) as exc:  # closed by another task: broken too
                self._closed = True
                raise BrokenError(f"fast channel broken: {exc!r}", peer_id=self.peer_id) from None
            if k == 0:
                self._closed = True
                if got == 0:
                    return None
                raise BrokenError(f"fast channel ended mid-frame ({got}/{n})", peer_id=self.peer_id)
            got += k
        return view

    def _wake_when(self, nbytes: int) -> None:
        """Be woken for reading only once ``nbytes`` are buffered (or the peer closed). Only
        bytes the peer must still send for the current frame are waited for, so this never
        waits for data that will not come."""
        if nbytes != self._wake_at:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return
            self._wake_at = nbytes

    async def send_hello(self) -> None:
        await self._send_frame(HELLO)

    async def expect_hello(self) -> None:
        if bytes(await self.receive_some()) != HELLO:
            raise RemoteProtocolError("fast channel hello mismatch", peer_id=self.peer_id)

    def abort(self) -> None:
        """Close with a reset (SO_LINGER 0): the peer sees a broken channel, not a clean end."""
        if not self._closed:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def close(self) -> None:
        # also after a read or write marked the channel broken: the descriptor must be released
        self._closed = True
        self._sock.close()  # idempotent


async def connect(
    host: str, port: int, sid: bytes, *, send_key: bytes, recv_key: bytes, peer_id: str, frame_bytes: int
) -> FastChannel:
    """Initiator side of step 3 (the caller bounds it with a cancel scope)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect((host, port))
        await sock.send(sid)
        channel = FastChannel(
            sock, send_key=send_key, recv_key=recv_key, peer_id=peer_id, frame_bytes=frame_bytes
        )
        await channel.send_hello()
    except BaseException:
        sock.close()
        raise
    return channel


async def read_session_id(sock: trio.socket.SocketType) -> bytes | None:
    """Responder side of step 3: the first bytes of a new connection."""
    buf = bytearray()
    while len(buf) < SESSION_ID_BYTES:
        chunk = await sock.recv(SESSION_ID_BYTES - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _nonce(counter: int) -> bytes:
    return b"\x00\x00\x00\x00" + counter.to_bytes(8, "big")
