"""Screening of inbound Kademlia requests before py-libp2p's handler sees them (sans-IO).

Theory of operation
-------------------
The Kademlia wire format is a stream of frames: an unsigned varint length, then a protobuf
``Message``. ``FrameDecoder`` splits bytes into frames, refusing a length prefix over the cap
before buffering the body. ``screen_request`` then parses one frame and accepts it only if
it is a request this node answers, with sane sizes:

- a known message type; keys non-empty and at most 128 bytes (80 for ADD_PROVIDER);
- PUT_VALUE carries a record whose key matches and whose value the namespaced validator
  accepts (so unknown namespaces, oversize and expired values are refused here);
- ADD_PROVIDER is for a key in Lattica's form (a sha2-256 multihash, ``keys.py``) and carries
  at most 20 providers, each a parseable peer id with a bounded number of addresses.

Anything else raises ``RemoteProtocolError`` with the peer id; the I/O layer counts it, logs
it once, drops the stream and penalizes the peer. py-libp2p's own handler only ever sees
frames that passed.

A well-formed request to store something may still be more than this node stores for its
sender: ``quota_refusal`` asks the store ledger (``quota.py``) first, so a refused record never
reaches the library. That is a refusal, not bad input: the stream is reset, nothing is banned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import multihash
from google.protobuf.message import DecodeError
from libp2p.kad_dht.pb.kademlia_pb2 import Message

from lattica.dht.quota import (
    Refusal,
    StoreLedger,
    provider_cost,
    provider_entry,
    value_cost,
    value_entry,
)
from lattica.errors import RemoteProtocolError

MAX_KEY_BYTES = 128
MAX_PROVIDER_KEY_BYTES = 80
_SHA2_256_KEY = (b"\x12\x20", 34)  # multihash prefix and length of every Lattica provider key
MAX_PROVIDERS_PER_MESSAGE = 20
_VARINT_MAX_BYTES = 10
_REQUEST_TYPES = frozenset(
    {
        Message.MessageType.PUT_VALUE,
        Message.MessageType.GET_VALUE,
        Message.MessageType.ADD_PROVIDER,
        Message.MessageType.GET_PROVIDERS,
        Message.MessageType.FIND_NODE,
        Message.MessageType.PING,
    }
)

_Reject = Callable[[str], RemoteProtocolError]  # why -> the error that rejects the request


class RecordValidator(Protocol):
    def validate(self, key: str, value: bytes) -> None: ...


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class FrameDecoder:
    """Bytes in, varint-prefixed frame bodies out; oversize prefixes are refused early."""

    def __init__(self, *, max_frame: int, peer_id: str | None = None) -> None:
        self._max_frame = max_frame
        self._peer_id = peer_id
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        length, header = self._read_length()
        if length is None or len(self._buf) < header + length:
            return None
        body = bytes(self._buf[header : header + length])
        del self._buf[: header + length]
        return body

    def _read_length(self) -> tuple[int | None, int]:
        value = 0
        for i, byte in enumerate(self._buf[:_VARINT_MAX_BYTES]):
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                if value > self._max_frame:
                    raise RemoteProtocolError(
                        f"DHT frame of {value} bytes exceeds {self._max_frame}",
                        peer_id=self._peer_id,
                    )
                return value, i + 1
        if len(self._buf) >= _VARINT_MAX_BYTES:
            raise RemoteProtocolError("DHT frame length is not a varint", peer_id=self._peer_id)
        return None, 0


def screen_request(frame: bytes, *, validator: RecordValidator, peer_id: str | None = None) -> Message:
    """Parse and check one inbound request frame; raise ``RemoteProtocolError`` if bad."""

    def reject(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"DHT request rejected: {why}", peer_id=peer_id)

    msg = Message()
    try:
        msg.ParseFromString(frame)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise reject(f"not a Kademlia protobuf ({type(exc).__name__})") from None
    if msg.type not in _REQUEST_TYPES:
        raise reject(f"unknown message type {msg.type}")
    if msg.type != Message.MessageType.PING and not 0 < len(msg.key) <= MAX_KEY_BYTES:
        raise reject(f"key of {len(msg.key)} bytes")
    if msg.type == Message.MessageType.PUT_VALUE:
        _screen_put_value(msg, validator, reject)
    elif msg.type == Message.MessageType.ADD_PROVIDER:
        _screen_add_provider(msg, reject)
    return msg


def _screen_put_value(msg: Message, validator: RecordValidator, reject: _Reject) -> None:
    if not msg.HasField("record") or msg.record.key != msg.key or not msg.record.value:
        raise reject("PUT_VALUE without a matching record")
    try:
        key = msg.key.decode("utf-8")
    except UnicodeDecodeError:
        raise reject("PUT_VALUE key is not UTF-8") from None
    try:
        validator.validate(key, msg.record.value)
    except Exception as exc:  # noqa: BLE001 - the namespaced validator dispatches to library validators that raise their own kinds
        raise reject(f"invalid record for {key[:60]!r}: {str(exc)[:120]}") from None


def _screen_add_provider(msg: Message, reject: _Reject) -> None:
    if len(msg.key) > MAX_PROVIDER_KEY_BYTES:
        raise reject(f"ADD_PROVIDER key of {len(msg.key)} bytes")
    prefix, length = _SHA2_256_KEY
    if len(msg.key) != length or not msg.key.startswith(prefix):
        raise reject("ADD_PROVIDER key is not a sha2-256 multihash")
    if not 0 < len(msg.providerPeers) <= MAX_PROVIDERS_PER_MESSAGE:
        raise reject(f"ADD_PROVIDER with {len(msg.providerPeers)} providers")
    for provider in msg.providerPeers:
        try:
            multihash.decode(provider.id)
        except ValueError:
            raise reject("ADD_PROVIDER with an unparseable peer id") from None
        if len(provider.addrs) > 32:
            raise reject("ADD_PROVIDER with too many addresses")


def quota_refusal(msg: Message, *, sender: str, sender_id: bytes, ledger: StoreLedger) -> Refusal | None:
    """Whether the ledger refuses what a screened request asks this node to store for ``sender``
    (``sender_id``: its peer id's bytes); None for requests that store nothing."""
    if msg.type == Message.MessageType.PUT_VALUE:
        return ledger.check(value_entry(msg.key), sender, value_cost(msg.key, msg.record.value))
    if msg.type == Message.MessageType.ADD_PROVIDER:
        for provider in msg.providerPeers:
            if provider.id == sender_id:  # the library stores a record for the sender only
                cost = provider_cost(msg.key, provider.id, provider.addrs)
                return ledger.check(provider_entry(msg.key, sender), sender, cost)
    return None
