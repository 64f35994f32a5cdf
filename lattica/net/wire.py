"""Length-prefixed msgpack messages on a libp2p stream — the framing of every control protocol.

Frame: 4-byte big-endian body length, then a msgpack body. The length is checked against the
caller's cap *before* anything is allocated, and msgpack is decoded with its own size limits,
so a lying or hostile peer costs at most ``max_size`` bytes of memory. Anything malformed is a
``RemoteProtocolError`` carrying the peer id.
"""

from __future__ import annotations

import struct
from typing import Protocol

import msgpack

from lattica.errors import BrokenError, RemoteProtocolError

_HEADER = struct.Struct(">I")
DEFAULT_MAX_MESSAGE = 1 << 20


class ByteStream(Protocol):
    """All that framing needs of a stream: a libp2p ``INetStream`` or a wrapper around one
    (``MeteredStream`` counts the bytes), so the codec does not care which it is given."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


def encode_message(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes, *, peer_id: str | None = None) -> object:
    """The decoded body, untrusted: callers narrow it (see ``lattica.decoding``)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"malformed message: {exc}", peer_id=peer_id) from None


async def read_exactly(stream: ByteStream, n: int, *, peer_id: str | None = None) -> bytes:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        try:
            chunk = await stream.read(remaining)
        except EOFError:  # StreamEOF / MuxedStreamEOF
            chunk = b""
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
            raise BrokenError(f"stream broken: {exc!r}", peer_id=peer_id) from None
        if not chunk:
            raise BrokenError(
                f"stream ended after {n - remaining} of {n} bytes", peer_id=peer_id
            )
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


async def read_message(
    stream: ByteStream, *, max_size: int = DEFAULT_MAX_MESSAGE, peer_id: str | None = None
) -> object:
    """Read one framed message; raises ``RemoteProtocolError`` or ``BrokenError``."""
    (length,) = _HEADER.unpack(await read_exactly(stream, _HEADER.size, peer_id=peer_id))
    if length > max_size:
        raise RemoteProtocolError(
            f"message of {length} bytes exceeds the {max_size}-byte limit", peer_id=peer_id
        )
    return decode_body(await read_exactly(stream, length, peer_id=peer_id), peer_id=peer_id)


async def write_message(stream: ByteStream, obj: object, *, peer_id: str | None = None) -> None:
    try:
        await stream.write(encode_message(obj))
    except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
        raise BrokenError(f"cannot write to stream: {exc!r}", peer_id=peer_id) from None
