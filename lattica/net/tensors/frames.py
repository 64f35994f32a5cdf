"""Sans-IO framing of tensor messages on a byte stream (a libp2p stream or a fast channel).

Theory of operation
-------------------
A message is ``u32 header length | msgpack header | payload``. Kinds of header:

- ``{"k": "put", "tag": str, "part": int, "t": [[name, dtype, shape, codec], ...]}`` followed
  by the concatenated codec payloads of the listed tensors. The payload length is *computed*
  from the specs, never declared separately, so a header cannot lie about it.
- ``{"k": "fetch", "tag": str, "names": [str, ...]}``: ask the owner of named tensors to send
  them back as a ``put`` under ``tag``. No payload.

``FrameDecoder`` is fed bytes and returns events. After an ``Incoming`` event the caller must
decide, before any payload byte is stored, whether to ``accept(buffer)`` (a buffer of exactly
``payload_size`` bytes it reserved under its memory limits) or ``discard()`` (skip the bytes).
The decoder never allocates more than ``max_header`` bytes on its own. Anything malformed is a
``RemoteProtocolError``; the caller drops the peer.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack

from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.numerics.codecs import TensorSpec, spec_from_wire

_LEN = struct.Struct(">I")
MAX_TAG = 1024
MAX_PART = 1 << 20
MAX_TENSORS = 65536
DEFAULT_MAX_HEADER = 4 << 20


@dataclass(frozen=True, slots=True)
class Incoming:
    """A parsed header; the payload has not been read yet."""

    kind: str
    tag: str
    part: int
    specs: tuple[TensorSpec, ...]
    names: tuple[str, ...]

    @property
    def payload_size(self) -> int:
        return sum(s.payload_size for s in self.specs)


@dataclass(frozen=True, slots=True)
class Complete:
    """A whole message; ``payload`` is the buffer given to ``accept`` (or None if discarded)."""

    incoming: Incoming
    payload: bytearray | memoryview | None


def encode_put(tag: str, part: int, specs: list[TensorSpec]) -> bytes:
    return _frame({"k": "put", "tag": tag, "part": part, "t": [s.to_wire() for s in specs]})


def encode_fetch(tag: str, names: list[str]) -> bytes:
    return _frame({"k": "fetch", "tag": tag, "names": list(names)})


def _frame(header: Mapping[str, object]) -> bytes:
    body: bytes = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Bytes in, ``Incoming`` / ``Complete`` events out. One instance per stream."""

    def __init__(self, *, peer_id: str | None = None, max_header: int = DEFAULT_MAX_HEADER):
        self._peer_id = peer_id
        self._max_header = max_header
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0
        self._state = "length"
        self._need = _LEN.size
        self._incoming: Incoming | None = None
        self._target: memoryview | None = None
        self._buffer: bytearray | memoryview | None = None
        self._filled = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes. The decoder keeps no reference to ``data`` once ``next_event`` has
        returned None, so the caller may reuse its buffer from then on."""
        if data:
            self._chunks.append(memoryview(data).cast("B"))
            self._buffered += len(data)

    @property
    def idle(self) -> bool:
        """True between messages with nothing buffered (a clean place for the stream to end)."""
        return self._state == "length" and self._buffered == 0

    def accept(self, buffer: bytearray | memoryview) -> None:
        incoming = self._awaiting()
        if len(buffer) != incoming.payload_size:
            raise LocalProtocolError("accept() needs a buffer of exactly payload_size bytes")
        self._buffer, self._target, self._filled = buffer, memoryview(buffer), 0
        self._state = "payload"

    def discard(self) -> None:
        self._awaiting()
        self._buffer, self._target, self._filled = None, None, 0
        self._state = "payload"

    def drop_payload(self) -> None:
        """Write no more of the current payload anywhere: the rest of it is read and skipped,
        and its ``Complete`` event carries no payload."""
        if self._state == "payload":
            self._buffer, self._target = None, None

    def payload_window(self) -> memoryview | None:
        """The unfilled rest of the accepted payload buffer, when the next bytes of the stream
        may be written there directly (nothing is buffered); else None."""
        if self._state != "payload" or self._target is None or self._buffered:
            return None
        assert self._incoming is not None
        return self._target[self._filled : self._incoming.payload_size]

    @property
    def payload_filled(self) -> int:
        """How many bytes of the current payload have been stored (or skipped) so far."""
        return self._filled

    def wrote_directly(self, n: int) -> None:
        """``n`` bytes of the stream were written into ``payload_window()``."""
        window = self.payload_window()
        if window is None or n > len(window):
            raise LocalProtocolError("wrote_directly() without a large enough payload window")
        self._filled += n

    def next_event(self) -> Incoming | Complete | None:
        """The next event, or None when more bytes are needed (or a decision is pending)."""
        while True:
            if self._state == "decide":
                self._own_leftovers()
                return None
            if self._state == "payload":
                done = self._fill_payload()
                if done is not None or self._state == "payload":
                    return done  # None here: every buffered byte went into the payload
                continue
            if self._buffered < self._need:
                self._own_leftovers()
                return None
            raw = self._take(self._need)
            if self._state == "length":
                (self._need,) = _LEN.unpack(raw)
                if self._need > self._max_header:
                    raise self._error(f"header of {self._need} bytes exceeds {self._max_header}")
                self._state = "header"
            else:
                self._incoming = self._parse(raw)
                self._state, self._need = "decide", _LEN.size
                return self._incoming

    def _awaiting(self) -> Incoming:
        if self._state != "decide" or self._incoming is None:
            raise LocalProtocolError("no message header awaits a decision")
        return self._incoming

    def _fill_payload(self) -> Complete | None:
        incoming = self._incoming
        assert incoming is not None
        remaining = incoming.payload_size - self._filled
        while remaining and self._chunks:
            chunk = self._chunks[0]
            n = min(remaining, len(chunk))
            if self._target is not None:
                self._target[self._filled : self._filled + n] = chunk[:n]
            self._consume_front(n)
            self._filled += n
            remaining -= n
        if remaining:
            return None
        event = Complete(incoming, self._buffer)
        self._state, self._incoming, self._target, self._buffer = "length", None, None, None
        return event

    def _own_leftovers(self) -> None:
        if len(self._chunks) > 1 or (self._chunks and not isinstance(self._chunks[0].obj, bytes)):
            joined = b"".join(self._chunks)
            self._chunks = deque([memoryview(joined)] if joined else [])

    def _take(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self._chunks[0]
            k = min(n - len(out), len(chunk))
            out += chunk[:k]
            self._consume_front(k)
        return bytes(out)

    def _consume_front(self, n: int) -> None:
        chunk = self._chunks[0]
        if n == len(chunk):
            self._chunks.popleft()
        else:
            self._chunks[0] = chunk[n:]
        self._buffered -= n

    def _error(self, why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"bad tensor frame: {why}", peer_id=self._peer_id)

    def _parse(self, raw: bytes) -> Incoming:
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise self._error(f"malformed header ({type(exc).__name__})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a map")
        kind, tag = header.get("k"), header.get("tag")
        if not isinstance(tag, str) or len(tag) > MAX_TAG:
            raise self._error("tag")
        if kind == "put":
            part, tensors = header.get("part"), header.get("t")
            if type(part) is not int or not 0 <= part < MAX_PART:
                raise self._error("part")
            if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
                raise self._error("tensor list")
            specs = tuple(spec_from_wire(t, peer_id=self._peer_id) for t in tensors)
            return Incoming("put", tag, part, specs, ())
        if kind == "fetch":
            names = header.get("names")
            if not isinstance(names, list) or len(names) > MAX_TENSORS:
                raise self._error("names")
            if not all(isinstance(n, str) and len(n) <= MAX_TAG for n in names):
                raise self._error("names")
            return Incoming("fetch", tag, 0, (), tuple(names))
        raise self._error(f"unknown message kind {kind!r}")
