"""Anti-entropy protocol: two peers exchange state vectors and send each other what is missing.

Theory of operation
-------------------
One session runs on one libp2p stream (``/lattica/state-sync/2.0.0``), framed by
``lattica.net.wire``::

    initiator -> responder   {"t": "hello", "v": 2, "run": run_id, "part": bool, "sv": [[doc, writer, have, head], ...]}
    responder -> initiator   {"t": "hello", "v": 2, "run": run_id, "part": bool, "sv": [...]}
    responder -> initiator   {"t": "envs", "envs": [[doc, seq, full, update, key, sig], ...]} * n, then {"t": "end"}
    initiator -> responder   {"t": "envs", ...} * m, then {"t": "end"}

An envelope travels without what its receiver derives (``compact``): the run is the session's,
the writer its key's peer id, ``""`` a writer's own document; a map as ``Envelope.to_wire``
writes it (what the state log stores) is read too. Each side computes what the other lacks from
the other's vector, so one session leaves both with the union of what they held. Only one side
writes at a time, so flow control cannot deadlock. Sessions are idempotent: an envelope that
arrives twice is recognized as a replay.
The same session is used for prompt pushes (the service starts one as soon as it has
something new) and for periodic repair, which is what makes the state converge after
partitions heal or messages are lost.

A responder over its node-wide serving budget (``state.py``) answers the hello with
``{"t": "busy"}`` instead and ends the session; the initiator raises ``PeerBusyError`` and tries
again later, as after any failed session — busy is not bad input. The responder asks the budget
for what it is about to send (``take``) before its hello, and answers busy if refused.

A row is written compactly: ``["", writer, have, head]`` for a writer's own document (the
document is the writer), the writer as the bytes of its peer id (the 32-byte key of an Ed25519
one; a name that is no peer id as is) and the head as its 8 bytes — 47 bytes a row instead of
74. A *full* hello lists every stream; a *partial* one (``"part": true``) is a push of the
initiator's news (``sync_plan``): it lists some streams only, the answer lists the answerer's
rows for those streams, and both sides send the envelopes of those streams alone. A hello
without ``"v": 2``, with a ``part`` that is not a bool, or with a row that names no writer is
malformed. Version 1 (``/lattica/state-sync/1.0.0``: full hellos only, rows spelled out) is
neither served nor opened: a node of either version does not list the other's protocol, so the
two are not synced with each other (``serves_sync``) rather than misreading each other's
messages or leases (version 2 writers may renew more slowly, ``LeasePolicy``).

A peer that sends a malformed frame, a wrong run id, or an envelope that fails its signature
or permission check ends the session with ``RemoteProtocolError``; replays do not.
Timeouts are the caller's (``trio.fail_after`` around a session). Sessions are opened only to
peers that may serve the protocol (``serves_sync``): not to one whose identify lists protocols
without it, such as a plain libp2p relay or DHT server among the bootstrap peers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from lattica.crdt.envelope import Envelope
from lattica.crdt.liveness import network_origin
from lattica.crdt.streams import StreamKey
from lattica.errors import PeerBusyError, RemoteProtocolError
from lattica.net.host import peer_may_support
from lattica.net.wire import read_message, write_message

SYNC_PROTOCOL = TProtocol("/lattica/state-sync/2.0.0")
VERSION = 2
MAX_FRAME_BYTES = 2 * 1024 * 1024
BATCH_BYTES = 512 * 1024
MAX_BATCHES = 10_000
_MAX_WRITER_BYTES = 64  # a peer id's bytes in a hello row
BUSY: dict[str, object] = {"t": "busy"}
_VECTOR_ROW_BYTES = 96  # a state-vector row on the wire: document, writer id, count, head digest


class SyncEndpoint(Protocol):
    """What a session needs from the local replica (implemented by ``ReplicatedState``)."""

    run_id: str

    def state_vector(self) -> list[list[str | int]]: ...

    def missing_for(self, vector: object) -> list[Envelope]: ...

    async def accept_batch(self, wire_envelopes: list[object], *, from_peer: str) -> None: ...


def serves_sync(host: IHost, peer: str) -> bool:
    """Whether a session with ``peer`` is worth opening, by what its identify said (pushed
    again when its services start, so a Lattica peer is synced once its state service runs)."""
    return peer_may_support(host, ID.from_base58(peer), SYNC_PROTOCOL)


# -- sans-IO message helpers ---------------------------------------------------------------------


def hello(run_id: str, vector: list[list[str | int]], *, partial: bool = False) -> dict[str, object]:
    rows = [["" if row[0] == row[1] else row[0], _packed_writer(str(row[1])), *row[2:3], *map(_packed_head, row[3:])]
            for row in vector]
    return {"t": "hello", "v": VERSION, "run": run_id, "part": partial, "sv": rows}


_ED25519_ID = bytes.fromhex("002408011220")  # an identity multihash of a protobuf Ed25519 key: the rest is the key


@functools.lru_cache(maxsize=16_384)
def _packed_writer(writer: str) -> str | bytes:
    """A peer id as its bytes (the 32-byte key for an Ed25519 one); a name that is none, as is."""
    try:
        raw = ID.from_base58(writer).to_bytes()
    except ValueError:
        return writer
    if raw.startswith(_ED25519_ID) and len(raw) == len(_ED25519_ID) + 32:
        return raw[len(_ED25519_ID):]
    return raw if 0 < len(raw) <= _MAX_WRITER_BYTES and len(raw) != 32 and _unpacked_writer(raw) == writer else writer


@functools.lru_cache(maxsize=16_384)
def _unpacked_writer(writer: bytes) -> str:
    return ID(_ED25519_ID + writer if len(writer) == 32 else writer).to_base58()


def _packed_head(head: str | int) -> str | int | bytes:
    try:
        return bytes.fromhex(head) if isinstance(head, str) else head
    except ValueError:
        return head


def parse_hello(obj: object, *, run_id: str, peer_id: str) -> tuple[list[object], bool]:
    """A ``hello`` -> (the peer's state vector, whether it is partial); its rows are checked
    by the replica. ``busy`` -> ``PeerBusyError``."""
    if obj == BUSY:
        raise PeerBusyError("peer is busy serving state; try again later", peer_id=peer_id)
    vector = obj.get("sv") if isinstance(obj, dict) and obj.get("t") == "hello" else None
    if not isinstance(obj, dict) or not isinstance(vector, list):
        raise RemoteProtocolError("expected a sync hello", peer_id=peer_id)
    if obj.get("run") != run_id:
        raise RemoteProtocolError(f"peer is in run {obj.get('run')!r}", peer_id=peer_id)
    partial = obj.get("part")
    if obj.get("v") != VERSION or not isinstance(partial, bool):
        raise RemoteProtocolError(f"expected a version-{VERSION} sync hello", peer_id=peer_id)
    return [_expand_row(row, peer_id) for row in vector], partial


def _expand_row(row: object, peer_id: str) -> object:
    """A hello's row as ``state_vector`` writes it: the document, the writer as its base58 peer
    id (``hello`` sends its bytes), the head in hex."""
    if not isinstance(row, list) or len(row) < 2:
        raise RemoteProtocolError("a state-vector row names no writer", peer_id=peer_id)
    writer = row[1]
    if isinstance(writer, bytes) and 0 < len(writer) <= _MAX_WRITER_BYTES:
        writer = _unpacked_writer(writer)
    if not isinstance(writer, str) or not writer:
        raise RemoteProtocolError("a state-vector row names no writer", peer_id=peer_id)
    tail = [head.hex() if isinstance(head, bytes) and len(head) <= 32 else head for head in row[3:4]]
    return [writer if row[0] == "" else row[0], writer, *row[2:3], *tail, *row[4:]]


def keys_of(vector: Iterable[object]) -> set[StreamKey]:
    """The streams a (checked) vector names."""
    return {(row[0], row[1]) for row in vector if isinstance(row, list) and len(row) >= 2
            and isinstance(row[0], str) and isinstance(row[1], str)}


def rows_among(vector: Iterable[list[str | int]], keys: Collection[StreamKey]) -> list[list[str | int]]:
    return [row for row in vector if (row[0], row[1]) in keys]


def envelopes_among(envelopes: Iterable[Envelope], keys: Collection[StreamKey] | None) -> list[Envelope]:
    return list(envelopes) if keys is None else [env for env in envelopes if env.stream in keys]


def batches(envelopes: Iterable[Envelope], *, max_bytes: int = BATCH_BYTES) -> list[dict[str, object]]:
    """Group envelopes into ``envs`` messages of about ``max_bytes`` each, each envelope compact
    (``compact``)."""
    out: list[dict[str, object]] = []
    current: list[object] = []
    size = 0
    for env in envelopes:
        cost = env.encoded_size()
        if current and size + cost > max_bytes:
            out.append({"t": "envs", "envs": current})
            current, size = [], 0
        current.append(compact(env))
        size += cost
    if current:
        out.append({"t": "envs", "envs": current})
    return out


def compact(env: Envelope) -> list[object]:
    """``[doc, seq, full, update, key, sig]``: an envelope without what its receiver derives —
    the run (the session's), the writer (its key's peer id), the document of a writer's own
    stream (``""``: the writer). About 180 bytes packed where ``to_wire`` takes 330."""
    return ["" if env.doc == env.writer else env.doc, env.seq, env.full, env.update, env.key, env.sig]


def expanded(item: object, run_id: str) -> object:
    """A ``compact`` envelope as ``Envelope.to_wire`` writes it; anything else as it is (the
    replica refuses what is malformed)."""
    if not isinstance(item, list) or len(item) != 6 or not isinstance(item[0], str) or not isinstance(item[4], bytes):
        return item
    writer = _writer_of(item[4])
    if writer is None:
        return item
    doc, seq, full, update, key, sig = item
    return {"run": run_id, "doc": doc or writer, "writer": writer, "seq": seq, "full": full, "update": update,
            "key": key, "sig": sig}


@functools.lru_cache(maxsize=16_384)
def _writer_of(key: bytes) -> str | None:
    try:
        return ID.from_pubkey(deserialize_public_key(key)).to_base58()
    except Exception:  # noqa: BLE001 - libp2p's key deserializers raise protobuf, cryptography and own errors on untrusted bytes
        return None


def parse_batch(obj: object, *, peer_id: str, run_id: str = "") -> list[object] | None:
    """An ``envs`` message -> its raw envelopes (checked by the replica), compact ones expanded
    for the session's ``run_id``; ``end`` -> None."""
    if isinstance(obj, dict) and obj.get("t") == "end":
        return None
    envs = obj.get("envs") if isinstance(obj, dict) and obj.get("t") == "envs" else None
    if isinstance(envs, list):
        return [expanded(item, run_id) for item in envs]
    raise RemoteProtocolError("expected an envs or end message", peer_id=peer_id)


# -- the session over a stream -------------------------------------------------------------------


async def _send_all(stream: INetStream, messages: Sequence[dict[str, object]], peer_id: str) -> None:
    for message in messages:
        await write_message(stream, message, peer_id=peer_id)
    await write_message(stream, {"t": "end"}, peer_id=peer_id)


async def _receive_all(stream: INetStream, endpoint: SyncEndpoint, peer_id: str) -> None:
    for _ in range(MAX_BATCHES):
        raw = parse_batch(
            await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), peer_id=peer_id,
            run_id=endpoint.run_id,
        )
        if raw is None:
            return
        await endpoint.accept_batch(raw, from_peer=peer_id)
    raise RemoteProtocolError("too many batches in one session", peer_id=peer_id)


async def initiate(
    stream: INetStream, endpoint: SyncEndpoint, *, peer_id: str, news: Collection[StreamKey] | None = None,
) -> None:
    """One session; with ``news``, a partial one over those streams."""
    vector = endpoint.state_vector()
    mine = vector if news is None else rows_among(vector, news)
    partial = news is not None
    await write_message(stream, hello(endpoint.run_id, mine, partial=partial), peer_id=peer_id)
    theirs, _ = parse_hello(
        await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), run_id=endpoint.run_id, peer_id=peer_id,
    )
    await _receive_all(stream, endpoint, peer_id)
    await _send_all(stream, batches(envelopes_among(endpoint.missing_for(theirs), news)), peer_id)


async def respond(
    stream: INetStream, endpoint: SyncEndpoint, *, peer_id: str, take: Callable[[int], bool] = lambda nbytes: True
) -> bool:
    """Answer one session; True when answered, False when ``take(nbytes)`` refused what this
    side would send and the session was answered busy."""
    theirs, partial = parse_hello(
        await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), run_id=endpoint.run_id, peer_id=peer_id,
    )
    among = keys_of(theirs) if partial else None
    vector = endpoint.state_vector()
    if among is not None:
        vector = rows_among(vector, among)
    missing = envelopes_among(endpoint.missing_for(theirs), among)
    if not take(len(vector) * _VECTOR_ROW_BYTES + sum(env.encoded_size() for env in missing)):
        await refuse_busy(stream, peer_id=peer_id)
        return False
    await write_message(stream, hello(endpoint.run_id, vector, partial=partial), peer_id=peer_id)
    await _send_all(stream, batches(missing), peer_id)
    await _receive_all(stream, endpoint, peer_id)
    return True


async def refuse_busy(stream: INetStream, *, peer_id: str) -> None:
    """Answer a session with ``busy`` (the initiator's hello is left unread)."""
    await write_message(stream, BUSY, peer_id=peer_id)


def observed_origin(stream: INetStream) -> str | None:
    """The network origin of the connection ``stream`` runs on, as we observe it."""
    try:
        relayed = stream.muxed_conn.get_connection_type() is ConnectionType.RELAYED
        remote = stream.get_remote_address()
    except Exception:  # noqa: BLE001 - a stream whose connection is gone: no origin
        return None
    host = remote[0] if remote else None
    return network_origin(host if isinstance(host, str) else None, relayed=relayed)
