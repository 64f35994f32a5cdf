"""Signed update envelopes — sans-IO.

Theory of operation
-------------------
Every change to the replicated state is a pycrdt (Yjs) update produced by exactly one writer
(a peer id) against exactly one document. The writer wraps it in an envelope::

    run, doc, writer, seq, full, update, key, sig

``seq`` numbers the writer's updates to that document (1, 2, 3, ...) so that replicas can
describe what they hold as a small vector and replays are recognized. ``full`` marks a
snapshot: its update holds the whole document as of ``seq``, so it stands in for every
earlier envelope of the stream (this is how streams are compacted without breaking
signatures). ``key`` is the writer's libp2p public key; the peer id derives from it, so a
receiver checks that ``key`` hashes to ``writer`` and that ``sig`` (Ed25519) covers every
other field under a domain tag. Nothing here touches the network, the disk or a clock.

Decoding treats its input as hostile: wrong types, missing fields, oversized updates, a key
that is not Ed25519 or does not match the writer, or a bad signature raise ``RejectedUpdate``
(a ``RemoteProtocolError``) with a short machine-readable ``reason`` used by the counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from lattica.errors import RemoteProtocolError

SIGNING_DOMAIN = "lattica-state-envelope/1"
MAX_SEQ = 2**53
MAX_NAME_CHARS = 128
_MAX_KEY_BYTES = 128
_MAX_SIG_BYTES = 128


class RejectedUpdate(RemoteProtocolError):
    """An update that failed validation; ``reason`` names the check that failed."""

    def __init__(self, reason: str, message: str, *, peer_id: str | None = None) -> None:
        super().__init__(f"{reason}: {message}", peer_id=peer_id)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Envelope:
    run: str
    doc: str
    writer: str
    seq: int
    full: bool
    update: bytes
    key: bytes
    sig: bytes

    @property
    def stream(self) -> tuple[str, str]:
        return (self.doc, self.writer)

    def to_wire(self) -> dict[str, object]:
        return {
            "run": self.run,
            "doc": self.doc,
            "writer": self.writer,
            "seq": self.seq,
            "full": self.full,
            "update": self.update,
            "key": self.key,
            "sig": self.sig,
        }

    def encoded_size(self) -> int:
        return len(self.update) + len(self.key) + len(self.sig) + len(self.doc) + 128


def signed_bytes(run: str, doc: str, writer: str, seq: int, full: bool, update: bytes) -> bytes:
    packed: bytes = msgpack.packb([SIGNING_DOMAIN, run, doc, writer, seq, full, update], use_bin_type=True)
    return packed


def sign_envelope(
    key_pair: KeyPair, *, run: str, doc: str, seq: int, full: bool, update: bytes
) -> Envelope:
    writer = ID.from_pubkey(key_pair.public_key).to_base58()
    sig = key_pair.private_key.sign(signed_bytes(run, doc, writer, seq, full, update))
    return Envelope(run, doc, writer, seq, full, update, key_pair.public_key.serialize(), sig)


def envelope_from_wire(
    obj: object, *, max_update_bytes: int, peer_id: str | None = None
) -> Envelope:
    """Parse an untrusted wire object into an ``Envelope`` (structure only, no signature check)."""
    if not isinstance(obj, dict):
        raise RejectedUpdate("malformed", "envelope is not a map", peer_id=peer_id)
    fields = {
        "run": str, "doc": str, "writer": str, "seq": int,
        "full": bool, "update": bytes, "key": bytes, "sig": bytes,
    }
    for name, kind in fields.items():
        value = obj.get(name)
        if type(value) is not kind:
            raise RejectedUpdate("malformed", f"field {name!r} missing or mistyped", peer_id=peer_id)
    if len(obj["update"]) > max_update_bytes:
        raise RejectedUpdate(
            "oversized", f"update of {len(obj['update'])} bytes > {max_update_bytes}", peer_id=peer_id
        )
    if not 1 <= obj["seq"] <= MAX_SEQ:
        raise RejectedUpdate("malformed", "seq out of range", peer_id=peer_id)
    for name in ("run", "doc", "writer"):
        if not 0 < len(obj[name]) <= MAX_NAME_CHARS:
            raise RejectedUpdate("malformed", f"field {name!r} has a bad length", peer_id=peer_id)
    if len(obj["key"]) > _MAX_KEY_BYTES or len(obj["sig"]) > _MAX_SIG_BYTES:
        raise RejectedUpdate("malformed", "key or signature too long", peer_id=peer_id)
    return Envelope(**{name: obj[name] for name in fields})


def verify_envelope(env: Envelope, *, run: str, peer_id: str | None = None) -> None:
    """Check run, key-to-writer binding and signature; raise ``RejectedUpdate`` otherwise."""
    if env.run != run:
        raise RejectedUpdate("wrong_run", f"envelope for run {env.run!r}", peer_id=peer_id)
    try:
        public_key = deserialize_public_key(env.key)
    except Exception:  # noqa: BLE001 - libp2p's key deserializers raise protobuf, cryptography and own errors on untrusted bytes
        raise RejectedUpdate("malformed", "undecodable public key", peer_id=peer_id) from None
    if public_key.get_type() != KeyType.Ed25519:
        raise RejectedUpdate("malformed", "public key is not Ed25519", peer_id=peer_id)
    if ID.from_pubkey(public_key).to_base58() != env.writer:
        raise RejectedUpdate("forged", "key does not match the writer's peer id", peer_id=peer_id)
    message = signed_bytes(env.run, env.doc, env.writer, env.seq, env.full, env.update)
    try:
        valid = public_key.verify(message, env.sig)
    except Exception:  # noqa: BLE001 - any failure to verify a signature from the wire means: not valid
        valid = False
    if not valid:
        raise RejectedUpdate("forged", "bad signature", peer_id=peer_id)
