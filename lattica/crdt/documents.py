"""Document layout and typed views of the replicated run state.

Every writer (peer id) owns one pycrdt document named after its peer id; admins also write
the shared ``config`` document. A writer's document holds these root maps:

- ``member``      its membership record: addrs, device, throughput, reachability, lease,
                  heartbeat count, left flag, and ``peers``: the peers that proved themselves to
                  it on a live connection (its vouches, see ``liveness.py``);
- ``progress``    its current outer round (its weights hash is that round's in ``completed``, or
                  here when the round is older than those);
- ``completed``   round -> weights hash of its last completed rounds (64 hex digits stored as
                  their 32 bytes);
- ``checkpoints`` ``"<round>|<hash>|<holder>"`` -> True (a flat set, merge-friendly);
- ``experts``     expert id -> True for the experts it owns (SPES).

The ``config`` document has one root map ``config``: key -> JSON text of the value.

pycrdt stores numbers as float64, so integers that must stay exact (rounds, byte counts,
times in ms) are stored as decimal strings and parsed back by the readers below. Readers
treat document content as untrusted (a writer may put anything into its own document):
fields of the wrong type are ignored, never raised on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TypedDict

from pycrdt import Doc, Map

from lattica.crdt.liveness import MAX_VOUCHES, vouches
from lattica.decoding import bounded_text, finite_float, str_map

CONFIG_DOC = "config"
WRITER_ROOTS = ("member", "progress", "completed", "checkpoints", "experts")
MEMBER_FIELDS = ("addrs", "device", "throughput", "reachability", "role")
KEEP_COMPLETED_ROUNDS = 2  # each holds a 64-character hash: the bulk of a member's record
_MAX_TEXT = 512
_MAX_ADDRS = 32
_SEP = "|"
_HEX = frozenset("0123456789abcdef")


# -- typed views (what the readers below return) ------------------------------------------------


class MemberRecord(TypedDict):
    addrs: list[str]
    device: str | None
    throughput: float | None
    reachability: str | None
    role: str | None
    lease_expires_ms: int
    heartbeat: int
    left: bool
    peers: list[str]  # its vouches


class CompletedRound(TypedDict):
    round: int
    weights_hash: str


class ProgressRecord(TypedDict):
    round: int | None
    weights_hash: str | None
    completed: list[CompletedRound]


class Snapshot(TypedDict):
    members: dict[str, MemberRecord]
    progress: dict[str, ProgressRecord]
    config: dict[str, object]  # key -> JSON value, as written by an admin (untrusted shape)
    checkpoints: dict[str, dict[str, list[str]]]  # round -> content hash -> holders
    experts: dict[str, list[str]]  # expert id -> owners


class MemberFields(TypedDict, total=False):
    """The fields of a membership record a writer sets itself (validated by ``validate_member_fields``)."""

    addrs: list[str]
    device: str
    throughput: float
    reachability: str
    role: str


# -- exact integers ---------------------------------------------------------------------------


def encode_int(value: int) -> str:
    if type(value) is not int:
        raise ValueError(f"expected an int, got {type(value).__name__}")
    return str(value)


def decode_int(value: object) -> int | None:
    if not isinstance(value, str) or not 0 < len(value) <= 24:
        return None
    body = value[1:] if value.startswith("-") else value
    return int(value) if body.isdigit() and body.isascii() else None


# -- validation of local writes ----------------------------------------------------------------


def _check_text(name: str, value: object, *, allow_sep: bool = True) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_TEXT:
        raise ValueError(f"{name} must be a non-empty string of at most {_MAX_TEXT} chars")
    if not allow_sep and _SEP in value:
        raise ValueError(f"{name} must not contain {_SEP!r}")
    return value


def _check_round(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"round must be a non-negative int, got {value!r}")
    return value


def validate_member_fields(fields: Mapping[str, object]) -> MemberFields:
    unknown = set(fields) - set(MEMBER_FIELDS)
    if unknown:
        raise ValueError(f"unknown member fields: {sorted(unknown)}; allowed: {MEMBER_FIELDS}")
    clean: MemberFields = {}
    if "addrs" in fields:
        addrs = fields["addrs"]
        if isinstance(addrs, str) or not isinstance(addrs, Iterable):
            raise ValueError("addrs must be a list of strings")
        clean["addrs"] = [_check_text("addr", str(a)) for a in addrs][:_MAX_ADDRS]
    if "device" in fields:
        clean["device"] = _check_text("device", fields["device"])
    if "reachability" in fields:
        clean["reachability"] = _check_text("reachability", fields["reachability"])
    if "role" in fields:
        clean["role"] = _check_text("role", fields["role"])
    if "throughput" in fields:
        throughput = finite_float(fields["throughput"])
        if throughput is None:
            raise ValueError("throughput must be a finite number")
        clean["throughput"] = throughput
    return clean


# -- writers (mutate the local writer's own document) -------------------------------------------


def write_member(doc: Doc[Map[object]], fields: Mapping[str, object]) -> None:
    member = doc.get("member", type=Map)
    for name, value in validate_member_fields(fields).items():
        member[name] = value


def write_lease(
    doc: Doc[Map[object]], *, lease_expires_ms: int, heartbeat: int, left: bool = False,
    vouches: Iterable[str] | None = None,
) -> None:
    """A lease renewal (or, ``left``, its end), with the writer's vouches when given (``write_vouches``)."""
    member = doc.get("member", type=Map)
    member["lease_expires_ms"] = encode_int(lease_expires_ms)
    member["heartbeat"] = encode_int(heartbeat)
    if member.get("left") is not left:  # unchanged, it is not written again (every renewal would carry it)
        member["left"] = left
    if vouches is not None:
        write_vouches(doc, vouches)


def write_vouches(doc: Doc[Map[object]], peers: Iterable[str]) -> None:
    """The peers that proved themselves to the writer (sorted, at most ``MAX_VOUCHES``)."""
    clean = sorted({_check_text("peer", p) for p in peers})[:MAX_VOUCHES]
    doc.get("member", type=Map)["peers"] = clean


def write_progress(doc: Doc[Map[object]], *, round: int, weights_hash: str) -> None:
    _check_round(round)
    _check_text("weights_hash", weights_hash)
    """The round and its hash, kept in ``completed`` (the newest ``KEEP_COMPLETED_ROUNDS``); the
    hash is written again in ``progress`` only for a round older than those (a restart behind)."""
    progress = doc.get("progress", type=Map)
    progress["round"] = encode_int(round)
    completed = doc.get("completed", type=Map)
    completed[encode_int(round)] = _packed_hash(weights_hash)
    rounds = sorted(r for r in map(decode_int, completed.keys()) if r is not None)
    for old in rounds[:-KEEP_COMPLETED_ROUNDS]:
        del completed[encode_int(old)]
    if round in rounds[-KEEP_COMPLETED_ROUNDS:]:
        if "weights_hash" in progress:
            del progress["weights_hash"]
    else:
        progress["weights_hash"] = weights_hash


def _packed_hash(text: str) -> str | bytes:
    """A hash of 64 hex digits as its 32 bytes (half the bytes in every progress write); any other text as is."""
    return bytes.fromhex(text) if len(text) == 64 and all(c in _HEX for c in text) else text


def _hash_text(value: object) -> str | None:
    if isinstance(value, bytes | bytearray):
        return value.hex() if len(value) == 32 else None
    return _text_or_none(value)


def write_checkpoint(doc: Doc[Map[object]], *, round: int, hashes: Iterable[str], holder: str) -> None:
    _check_round(round)
    _check_text("holder", holder, allow_sep=False)
    checkpoints = doc.get("checkpoints", type=Map)
    for content_hash in hashes:
        _check_text("hash", content_hash, allow_sep=False)
        checkpoints[_SEP.join((encode_int(round), content_hash, holder))] = True


def write_expert(doc: Doc[Map[object]], *, expert: str, owned: bool) -> None:
    _check_text("expert", expert)
    experts = doc.get("experts", type=Map)
    if owned:
        experts[expert] = True
    elif expert in experts:
        del experts[expert]


def write_owned_experts(doc: Doc[Map[object]], experts: Iterable[str]) -> None:
    """Replace the writer's whole set of owned experts (one update for a new ownership map)."""
    wanted = {_check_text("expert", e) for e in experts}
    root = doc.get("experts", type=Map)
    present = set(root.keys())
    for expert in sorted(present - wanted):
        del root[expert]
    for expert in sorted(wanted - present):
        root[expert] = True


def write_config(doc: Doc[Map[object]], config: Mapping[str, object]) -> None:
    encoded = {}
    for key, value in config.items():
        _check_text("config key", key)
        try:
            encoded[key] = json.dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config value for {key!r} is not JSON: {exc}") from None
    root = doc.get("config", type=Map)
    for key in sorted(set(root.keys()) - set(encoded)):
        del root[key]
    for key, text in encoded.items():
        if root.get(key) != text:
            root[key] = text


def reassert(doc: Doc[Map[object]], wanted: Doc[Map[object]]) -> None:
    """Make a writer's ``doc`` hold exactly what ``wanted`` holds, root map by root map, by
    writing afresh every entry that differs: new writes are causally after everything ``doc``
    holds, so they win over entries that were written concurrently elsewhere."""
    for name in WRITER_ROOTS:
        want, have = _root(wanted, name), _root(doc, name)
        root = doc.get(name, type=Map)
        for key in sorted(set(have) - set(want)):
            del root[key]
        for key, value in want.items():
            if have.get(key) != value:
                root[key] = bytes(value) if isinstance(value, bytearray) else value  # read back as a bytearray


def compacted(doc: Doc[Map[object]]) -> Doc[Map[object]]:
    """A new document holding what ``doc`` holds now, without the history of its overwritten
    and deleted entries (which Yjs keeps: every lease renewal would otherwise add tens of bytes
    to a member's document for ever). Only the document's one writer may do this: replicas take
    the result as a snapshot that replaces their copy (``Replica``)."""
    fresh: Doc[Map[object]] = Doc()
    for name in WRITER_ROOTS:
        content = _root(doc, name)
        if content:
            root = fresh.get(name, type=Map)
            for key, value in sorted(content.items()):
                root[key] = bytes(value) if isinstance(value, bytearray) else value  # read back as a bytearray
    return fresh


# -- readers (untrusted content -> typed, JSON-able views) ---------------------------------------


def _root(doc: Doc[Map[object]], name: str) -> dict[str, object]:
    try:
        value: object = doc.get(name, type=Map).to_py()
    except Exception:  # noqa: BLE001 - pycrdt raises its own kinds for a root of another type (untrusted content)
        return {}
    return str_map(value) or {}


def _text_or_none(value: object) -> str | None:
    return bounded_text(value, max_len=_MAX_TEXT)


def read_member(doc: Doc[Map[object]]) -> MemberRecord | None:
    raw = _root(doc, "member")
    if not raw:
        return None
    addrs = raw.get("addrs")
    throughput = raw.get("throughput")
    return {
        "addrs": [a for a in addrs if isinstance(a, str)][:_MAX_ADDRS] if isinstance(addrs, list) else [],
        "device": _text_or_none(raw.get("device")),
        "throughput": throughput if isinstance(throughput, float) and math.isfinite(throughput) else None,
        "reachability": _text_or_none(raw.get("reachability")),
        "role": _text_or_none(raw.get("role")),
        "lease_expires_ms": decode_int(raw.get("lease_expires_ms")) or 0,
        "heartbeat": decode_int(raw.get("heartbeat")) or 0,
        "left": raw.get("left") is True,
        "peers": vouches(raw),
    }


def read_progress(doc: Doc[Map[object]]) -> ProgressRecord | None:
    raw = _root(doc, "progress")
    completed: list[CompletedRound] = []
    for key, value in _root(doc, "completed").items():
        round_ = decode_int(key)
        weights_hash = _hash_text(value)
        if round_ is not None and weights_hash:
            completed.append({"round": round_, "weights_hash": weights_hash})
    if not raw and not completed:
        return None
    completed.sort(key=lambda item: item["round"])
    round_ = decode_int(raw.get("round"))
    in_completed = [item["weights_hash"] for item in completed if item["round"] == round_]
    return {
        "round": round_,
        "weights_hash": _text_or_none(raw.get("weights_hash")) or (in_completed[0] if in_completed else None),
        "completed": completed[-KEEP_COMPLETED_ROUNDS:],
    }


def read_checkpoint_claims(doc: Doc[Map[object]]) -> list[tuple[int, str, str]]:
    claims = []
    for key, value in _root(doc, "checkpoints").items():
        parts = key.split(_SEP)
        round_ = decode_int(parts[0]) if len(parts) == 3 else None
        if value is True and round_ is not None and all(parts[1:]):
            claims.append((round_, parts[1], parts[2]))
    return claims


def read_experts(doc: Doc[Map[object]]) -> list[str]:
    return sorted(k for k, v in _root(doc, "experts").items() if v is True and len(k) <= _MAX_TEXT)


def read_config(doc: Doc[Map[object]]) -> dict[str, object]:
    config: dict[str, object] = {}
    for key, text in _root(doc, "config").items():
        if not isinstance(text, str):
            continue
        try:
            config[key] = json.loads(text)
        except ValueError:
            continue
    return dict(sorted(config.items()))


def build_snapshot(
    writer_docs: Mapping[str, Doc[Map[object]]], config_doc: Doc[Map[object]] | None
) -> Snapshot:
    """The whole state as plain JSON-able data; identical docs give identical snapshots."""
    members: dict[str, MemberRecord] = {}
    progress: dict[str, ProgressRecord] = {}
    experts: dict[str, list[str]] = {}
    checkpoints: dict[str, dict[str, set[str]]] = {}
    for writer in sorted(writer_docs):
        doc = writer_docs[writer]
        if (member := read_member(doc)) is not None:
            members[writer] = member
        if (prog := read_progress(doc)) is not None:
            progress[writer] = prog
        for round_, content_hash, holder in read_checkpoint_claims(doc):
            checkpoints.setdefault(str(round_), {}).setdefault(content_hash, set()).add(holder)
        for expert in read_experts(doc):
            experts.setdefault(expert, []).append(writer)
    manifest = {
        r: {h: sorted(holders) for h, holders in sorted(by_hash.items())}
        for r, by_hash in sorted(checkpoints.items(), key=lambda item: int(item[0]))
    }
    return {
        "members": members,
        "progress": progress,
        "config": read_config(config_doc) if config_doc is not None else {},
        "checkpoints": manifest,
        "experts": dict(sorted(experts.items())),
    }


def doc_from(update: bytes) -> Doc[Map[object]]:
    """A document rebuilt from one update (a snapshot or a document's full state)."""
    doc: Doc[Map[object]] = Doc()
    doc.apply_update(update)
    return doc
