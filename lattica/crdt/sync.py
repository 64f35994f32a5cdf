"""Anti-entropy protocol: two peers exchange state vectors and send each other what is missing.

Theory of operation
-------------------
One session runs on one libp2p stream (``/lattica/state-sync/3.0.0``), framed by
``lattica.net.wire``::

    initiator -> responder   {"t": "hello", "v": 3, "run": run_id, "part": bool, "sv": [[doc, tag, have, head], ...]}
    responder -> initiator   {"t": "hello", "v": 3, "run": run_id, "part": bool, "sv": [...]}
    responder -> initiator   {"t": "envs", "envs": [[doc, seq, full, update, key, sig], ...]} * n, then {"t": "end"}
    initiator -> responder   {"t": "envs", ...} * m, then {"t": "end"}

An envelope travels without what its receiver derives (``compact``): the run is the session's,
the writer its key's peer id, ``""`` a writer's own document, and the key, to a receiver whose
vector shows a stream of the writer, the writer's tag (below) when its peer id holds the key;
a map as ``Envelope.to_wire`` writes it (what the state log stores) is read too. Each side
computes what the other lacks from the other's vector, so one session leaves both with the union
of what they held. Only one side writes at a time, so flow control cannot deadlock. Sessions
are idempotent: an envelope that arrives twice is recognized as a replay; one whose tag names
no writer the receiver knows (forgotten meanwhile) is skipped.

A responder over its node-wide serving budget (``state.py``) answers the hello with
``{"t": "busy"}`` instead and ends the session; the initiator raises ``PeerBusyError`` and tries
again later, as after any failed session — busy is not bad input. The responder asks the budget
for what it is about to send (``take``) before its hello, and answers busy if refused.

A row names its writer by a *tag*, the first 8 bytes of the SHA-256 of its peer id
(``writer_tag``), its document as ``""`` when it is the writer's own, and the envelope at
``have`` by the 8 bytes of its digest: ~24 bytes a row. A reader resolves a tag among the
writers it knows (``resolved``: its streams' and the banned); a tag it does not know names a
stream it does not hold, and one that two of its writers share names neither (their envelopes
are then sent whole, as to a peer that holds none): a tag equal to a given writer's takes ~2^64
tries to find, so only identities ground together can share one. A *full* hello
lists every stream; a *partial* one (``"part": true``) is a push of the initiator's news
(``sync_plan``) with its rows' ``have`` only, and its answer lists only the rows where the
answerer differs (``differing``: its own ``have``, 0 for a stream or a tag it does not know),
so the answer to a rumour it already heard is empty; both sides then send the envelopes of the
pushed streams that the other lacks. A fork (one seq, two envelopes) shows in the heads of a
full session. A hello without ``"v": 3``, with a ``part`` that is not a bool, or with a row that
names no tag is malformed. Versions 1 and 2 (``/lattica/state-sync/1.0.0``, ``2.0.0``) are
neither served nor opened: a node of another version does not list this one's protocol, so the
two are not synced with each other (``serves_sync``) rather than misreading each other's rows or
leases (a version-3 writer renews its lease less often and with each write of its record,
``LeasePolicy``).

A peer that sends a malformed frame, a wrong run id, or an envelope that fails its signature
or permission check ends the session with ``RemoteProtocolError``; replays do not.
Timeouts are the caller's (``trio.fail_after`` around a session). Sessions are opened only to
peers that may serve the protocol (``serves_sync``): not to one whose identify lists protocols
without it, such as a plain libp2p relay or DHT server among the bootstrap peers.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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

SYNC_PROTOCOL = TProtocol("/lattica/state-sync/3.0.0")
VERSION = 3
TAG_BYTES = 8  # a writer's tag in a hello row
MAX_FRAME_BYTES = 2 * 1024 * 1024
BATCH_BYTES = 512 * 1024
MAX_BATCHES = 10_000
BUSY: dict[str, object] = {"t": "busy"}
_ROW_BYTES = 32  # a hello row on the wire: document, writer tag, count, head digest


class SyncEndpoint(Protocol):
    """What a session needs from the local replica (implemented by ``ReplicatedState``)."""

    run_id: str

    def state_vector(self) -> list[list[str | int]]: ...

    def writers(self) -> Collection[str]: ...  # whom a row may name: the streams' writers and the banned

    def missing_for(self, vector: object) -> list[Envelope]: ...

    async def accept_batch(self, wire_envelopes: list[object], *, from_peer: str) -> None: ...


def serves_sync(host: IHost, peer: str) -> bool:
    """Whether a session with ``peer`` is worth opening, by what its identify said (pushed
    again when its services start, so a Lattica peer is synced once its state service runs)."""
    return peer_may_support(host, ID.from_base58(peer), SYNC_PROTOCOL)


# -- sans-IO message helpers ---------------------------------------------------------------------


@functools.lru_cache(maxsize=16_384)
def writer_tag(writer: str) -> bytes:
    """How a hello row names a writer: the first 8 bytes of the SHA-256 of its peer id."""
    return hashlib.sha256(writer.encode()).digest()[:TAG_BYTES]


def hello(run_id: str, vector: Sequence[Sequence[object]], *, partial: bool = False) -> dict[str, object]:
    """``vector``'s rows (``[doc, writer, have, head]``; a writer given as a tag is sent as is)
    packed: ``["" or doc, tag, have, head]``, without the head in a partial hello."""
    return {"t": "hello", "v": VERSION, "run": run_id, "part": partial, "sv": [_packed(row, partial) for row in vector]}


def _packed(row: Sequence[object], partial: bool) -> list[object]:
    doc, writer, *rest = row
    tag = writer if isinstance(writer, bytes) else writer_tag(str(writer))
    head = [] if partial else [bytes.fromhex(h) if isinstance(h, str) and _is_hex(h) else h for h in rest[1:2]]
    return ["" if doc == writer else doc, tag, *rest[:1], *head]


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def parse_hello(obj: object, *, run_id: str, peer_id: str) -> tuple[list[list[object]], bool]:
    """A ``hello`` -> (its rows as sent, whether it is partial): each names a writer by its tag,
    the rest is checked by the replica. ``busy`` -> ``PeerBusyError``."""
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
    for row in vector:
        if not (isinstance(row, list) and 3 <= len(row) <= 4 and isinstance(row[0], str)
                and isinstance(row[1], bytes) and len(row[1]) == TAG_BYTES):
            raise RemoteProtocolError("a state-vector row names no writer", peer_id=peer_id)
    return vector, partial


def resolved(rows: Iterable[list[object]], writers: Iterable[str]) -> tuple[list[list[object]], list[list[object]]]:
    """A hello's rows -> (those naming one of ``writers`` as ``state_vector`` writes them: the
    writer's id, its document for ``""``, the head in hex; the rows whose tag names none of them,
    or two: unknown)."""
    by_tag = tags_of(writers)
    known, unknown = [], []
    for row in rows:
        writer = by_tag.get(row[1])  # type: ignore[call-overload]
        if writer is None:
            unknown.append(row)
            continue
        head = [h.hex() if isinstance(h, bytes) and len(h) <= 32 else h for h in row[3:4]]
        known.append([row[0] or writer, writer, row[2], *head])
    return known, unknown


def differing(
    mine: Iterable[list[str | int]], theirs: Iterable[list[object]], unknown: Iterable[list[object]],
) -> list[list[object]]:
    """The answer to a push: our rows for the streams it names where our ``have`` differs from
    the pusher's (a stream we lack: 0), and 0 for the rows naming writers we do not know. The
    answer to a rumour we hold already is empty."""
    haves = {(row[0], row[1]): row[2] for row in mine}
    rows: list[list[object]] = []
    for doc, writer, have, *_ in theirs:
        ours = haves.get((doc, writer), 0)  # type: ignore[arg-type]
        if ours != have:
            rows.append([doc, writer, ours])
    return rows + [[row[0], row[1], 0] for row in unknown]


def as_answered(pushed: Iterable[list[str | int]], answer: Iterable[list[object]]) -> list[list[object]]:
    """What the answerer of our push holds of its streams: ``pushed`` (our rows, without heads)
    but where its answer (resolved) differs."""
    view: dict[StreamKey, list[object]] = {(str(r[0]), str(r[1])): [r[0], r[1], r[2]] for r in pushed}
    for row in answer:
        key = (str(row[0]), str(row[1]))
        if key in view:
            view[key] = row
    return list(view.values())


def keys_of(vector: Iterable[object]) -> set[StreamKey]:
    """The streams a (checked) vector names."""
    return {(row[0], row[1]) for row in vector if isinstance(row, list) and len(row) >= 2
            and isinstance(row[0], str) and isinstance(row[1], str)}


def rows_among(vector: Iterable[list[str | int]], keys: Collection[StreamKey]) -> list[list[str | int]]:
    return [row for row in vector if (row[0], row[1]) in keys]


def envelopes_among(envelopes: Iterable[Envelope], keys: Collection[StreamKey] | None) -> list[Envelope]:
    return list(envelopes) if keys is None else [env for env in envelopes if env.stream in keys]


def batches(
    envelopes: Iterable[Envelope], *, max_bytes: int = BATCH_BYTES, holders: Collection[str] = (),
) -> list[dict[str, object]]:
    """Group envelopes into ``envs`` messages of about ``max_bytes`` each, each envelope compact
    (``compact``; ``holders``: the writers whose streams the receiver holds)."""
    out: list[dict[str, object]] = []
    current: list[object] = []
    size = 0
    for env in envelopes:
        cost = env.encoded_size()
        if current and size + cost > max_bytes:
            out.append({"t": "envs", "envs": current})
            current, size = [], 0
        current.append(compact(env, held=env.writer in holders))
        size += cost
    if current:
        out.append({"t": "envs", "envs": current})
    return out


def compact(env: Envelope, *, held: bool = False) -> list[object]:
    """``[doc, seq, full, update, key, sig]``: an envelope without what its receiver derives —
    the run (the session's), the writer (its key's peer id), the document of a writer's own
    stream (``""``: the writer) and, for a receiver that holds a stream of the writer (``held``)
    whose peer id holds its key (Ed25519), the key: its tag instead. About 150 bytes packed
    where ``to_wire`` takes 330."""
    key = writer_tag(env.writer) if held and _key_in_id(env.writer) == env.key else env.key
    return ["" if env.doc == env.writer else env.doc, env.seq, env.full, env.update, key, env.sig]


def expanded(item: object, run_id: str, by_tag: Mapping[bytes, str] | None = None) -> object | None:
    """A ``compact`` envelope as ``Envelope.to_wire`` writes it; anything else as it is (the
    replica refuses what is malformed); None for a key given by a tag that names none of
    ``by_tag``'s writers (one we forgot meanwhile: skipped, not bad input)."""
    if not isinstance(item, list) or len(item) != 6 or not isinstance(item[0], str) or not isinstance(item[4], bytes):
        return item
    doc, seq, full, update, key, sig = item
    if len(key) == TAG_BYTES:
        tagged = (by_tag or {}).get(key)
        key = _key_in_id(tagged) if tagged is not None else None
        if key is None:
            return None
    writer = _writer_of(key)
    if writer is None:
        return item
    return {"run": run_id, "doc": doc or writer, "writer": writer, "seq": seq, "full": full, "update": update,
            "key": key, "sig": sig}


@functools.lru_cache(maxsize=16_384)
def _writer_of(key: bytes) -> str | None:
    try:
        return ID.from_pubkey(deserialize_public_key(key)).to_base58()
    except Exception:  # noqa: BLE001 - libp2p's key deserializers raise protobuf, cryptography and own errors on untrusted bytes
        return None


@functools.lru_cache(maxsize=16_384)
def _key_in_id(writer: str) -> bytes | None:
    """The serialized public key a peer id holds (an identity multihash: Ed25519); None for one that hashes it."""
    try:
        raw = ID.from_base58(writer).to_bytes()
    except ValueError:
        return None
    return raw[2:] if len(raw) > 2 and raw[0] == 0 and raw[1] == len(raw) - 2 else None


def tags_of(writers: Iterable[str]) -> dict[bytes, str]:
    """tag -> writer for ``writers`` (a tag two of them share names neither, see ``resolved``)."""
    by_tag: dict[bytes, str | None] = {}
    for writer in writers:
        tag = writer_tag(writer)
        by_tag[tag] = writer if by_tag.get(tag, writer) == writer else None
    return {tag: writer for tag, writer in by_tag.items() if writer is not None}


def holders(vector: Iterable[list[object]]) -> set[str]:
    """The writers of the streams a (resolved) vector holds something of."""
    return {str(row[1]) for row in vector if type(row[2]) is int and row[2] > 0}


def parse_batch(
    obj: object, *, peer_id: str, run_id: str = "", by_tag: Mapping[bytes, str] | None = None,
) -> list[object] | None:
    """An ``envs`` message -> its raw envelopes (checked by the replica), compact ones expanded
    for the session's ``run_id`` (a tagged key among ``by_tag``'s writers, see ``expanded``);
    ``end`` -> None."""
    if isinstance(obj, dict) and obj.get("t") == "end":
        return None
    envs = obj.get("envs") if isinstance(obj, dict) and obj.get("t") == "envs" else None
    if isinstance(envs, list):
        return [raw for item in envs if (raw := expanded(item, run_id, by_tag)) is not None]
    raise RemoteProtocolError("expected an envs or end message", peer_id=peer_id)


# -- the session over a stream -------------------------------------------------------------------


async def _send_all(stream: INetStream, messages: Sequence[dict[str, object]], peer_id: str) -> None:
    for message in messages:
        await write_message(stream, message, peer_id=peer_id)
    await write_message(stream, {"t": "end"}, peer_id=peer_id)


async def _receive_all(stream: INetStream, endpoint: SyncEndpoint, peer_id: str) -> None:
    by_tag = tags_of(endpoint.writers())
    for _ in range(MAX_BATCHES):
        raw = parse_batch(
            await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), peer_id=peer_id,
            run_id=endpoint.run_id, by_tag=by_tag,
        )
        if raw is None:
            return
        await endpoint.accept_batch(raw, from_peer=peer_id)
    raise RemoteProtocolError("too many batches in one session", peer_id=peer_id)


async def initiate(
    stream: INetStream, endpoint: SyncEndpoint, *, peer_id: str, news: Collection[StreamKey] | None = None,
) -> None:
    """One session; with ``news``, a partial one over those streams (a push)."""
    vector = endpoint.state_vector()
    mine = vector if news is None else rows_among(vector, news)
    await write_message(stream, hello(endpoint.run_id, mine, partial=news is not None), peer_id=peer_id)
    rows, _ = parse_hello(
        await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), run_id=endpoint.run_id, peer_id=peer_id,
    )
    theirs, _ = resolved(rows, endpoint.writers())
    await _receive_all(stream, endpoint, peer_id)
    if news is not None:
        theirs = as_answered(mine, theirs)
    await _send_all(stream, batches(envelopes_among(endpoint.missing_for(theirs), news), holders=holders(theirs)),
                    peer_id)


async def respond(
    stream: INetStream, endpoint: SyncEndpoint, *, peer_id: str, take: Callable[[int], bool] = lambda nbytes: True
) -> bool:
    """Answer one session; True when answered, False when ``take(nbytes)`` refused what this
    side would send and the session was answered busy."""
    rows, partial = parse_hello(
        await read_message(stream, max_size=MAX_FRAME_BYTES, peer_id=peer_id), run_id=endpoint.run_id, peer_id=peer_id,
    )
    theirs, unknown = resolved(rows, endpoint.writers())
    vector = endpoint.state_vector()
    among = keys_of(theirs) if partial else None
    answer = differing(vector, theirs, unknown) if partial else vector
    missing = envelopes_among(endpoint.missing_for(theirs), among)
    if not take(len(answer) * _ROW_BYTES + sum(env.encoded_size() for env in missing)):
        await refuse_busy(stream, peer_id=peer_id)
        return False
    await write_message(stream, hello(endpoint.run_id, answer, partial=partial), peer_id=peer_id)
    await _send_all(stream, batches(missing, holders=holders(theirs)), peer_id)
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
