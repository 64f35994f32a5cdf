"""The messages between the daemon and its rank processes: length-prefixed msgpack maps.

Each message is a 4-byte big-endian length and a msgpack map with an ``op`` key. The daemon
writes to a rank's stdin and reads its stdout (a rank writes its logs to stderr), so the
channel is private to the two processes. Weights never travel here: they go through the
shared buffer of ``weights.py``; messages carry step numbers, the sampler's state (a few KiB)
and figures. ``MessageReader`` is the sans-IO decoder: bytes in, messages out; a length over
``MAX_MESSAGE_BYTES`` or a payload that is not a map with a string ``op`` is a
``LocalProtocolError`` (the rank is then treated as failed).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from lattica.errors import LocalProtocolError

MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct(">I")

Message = dict[str, Any]


def encode(message: Message) -> bytes:
    payload: bytes = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"rank message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(payload)) + payload


class MessageReader:
    """Accumulates bytes and yields each complete message."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                raise LocalProtocolError(f"rank message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
            if len(self._buffer) < _HEADER.size + length:
                break
            payload = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
            del self._buffer[: _HEADER.size + length]
            messages.append(decode(payload))
        return messages


def decode(payload: bytes) -> Message:
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise LocalProtocolError(f"malformed rank message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise LocalProtocolError("rank message is not a map with an 'op'")
    return message
