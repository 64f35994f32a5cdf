"""The peer book across restarts: the members a node knew, saved in its data dir.

Theory of operation: a node that restarts — above all the one that started the swarm, which has
no ``--peer`` to dial — reconnects to the members it knew before. The connectivity saves the
members it has been connected to (a Lattica protocol spoken on a live connection) to
``<data-dir>/known-peers.json``: at most ``MAX_SAVED_PEERS``, the most recently connected first,
each with up to ``MAX_SAVED_ADDRS`` of the addresses the peer vouched for itself (never
addresses only heard through peer exchange) and when it was last connected. The file is
written atomically (a 0600 temporary, fsync, rename, fsync of the folder), so a kill at any
moment leaves the old or the new book.

On start the file is read as untrusted input: at most ``MAX_FILE_BYTES``, JSON of the expected
shape, each entry a well-formed peer id with addresses that parse and end in that id, a time
that is not in the future; entries older than ``REMEMBER_FOR_S`` are dropped. An entry that
fails is skipped; a file that fails as a whole (not JSON, another shape) is ignored with one
warning and replaced at the next save — the book is a cache, never a reason not to start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from lattica.net.peerbook import PeerRecord

log = logging.getLogger(__name__)

SAVED_PEERS_FILE = "known-peers.json"
MAX_SAVED_PEERS = 256
MAX_SAVED_ADDRS = 8
MAX_SAVED_CIRCUITS = 3  # of the MAX_SAVED_ADDRS: a NAT'd member's relay addresses
MAX_ADDR_LEN = 256
MAX_FILE_BYTES = 1024 * 1024
REMEMBER_FOR_S = 30 * 24 * 3600.0
_FUTURE_SLACK_S = 24 * 3600.0  # clocks move; a time further ahead is not one we wrote
_VERSION = 1
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{40,60}$")


@dataclass(frozen=True)
class SavedPeer:
    peer_id: str
    addrs: tuple[str, ...]
    last_connected: float


def saved_from_book(records: Iterable[PeerRecord]) -> list[SavedPeer]:
    """The members worth remembering: connected at some point, with addresses of their own."""
    known = [r for r in records if r.member and r.last_connected > 0 and r.addrs]
    known.sort(key=lambda r: r.last_connected, reverse=True)
    return [SavedPeer(r.peer_id, _pick_addrs(r.addrs), r.last_connected) for r in known[:MAX_SAVED_PEERS]]


def _pick_addrs(addrs: list[str]) -> tuple[str, ...]:
    fitting = [a for a in addrs if len(a) <= MAX_ADDR_LEN]
    circuits = [a for a in fitting if "/p2p-circuit" in a][:MAX_SAVED_CIRCUITS]
    direct = [a for a in fitting if "/p2p-circuit" not in a][: MAX_SAVED_ADDRS - len(circuits)]
    return tuple(direct + circuits)


def encode(peers: Iterable[SavedPeer]) -> bytes:
    entries = [{"id": p.peer_id, "addrs": list(p.addrs), "last_connected": p.last_connected} for p in peers]
    return json.dumps({"version": _VERSION, "peers": entries}, indent=1).encode()


def decode(raw: bytes, *, self_id: str, now: float) -> tuple[list[SavedPeer], int]:
    """The valid entries of a saved book and how many were skipped; ``ValueError`` when
    ``raw`` is no saved book at all."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc.__class__.__name__})") from None
    entries = obj.get("peers") if isinstance(obj, dict) and obj.get("version") == _VERSION else None
    if type(entries) is not list:
        raise ValueError(f"not a version-{_VERSION} peer book")
    peers: dict[str, SavedPeer] = {}
    skipped = 0
    for entry in entries[: MAX_SAVED_PEERS * 4]:
        peer = _entry(entry, now=now)
        if peer is None or peer.peer_id == self_id or peer.peer_id in peers:
            skipped += 1
            continue
        peers[peer.peer_id] = peer
    skipped += max(0, len(entries) - MAX_SAVED_PEERS * 4)
    best = sorted(peers.values(), key=lambda p: p.last_connected, reverse=True)
    skipped += max(0, len(best) - MAX_SAVED_PEERS)
    return best[:MAX_SAVED_PEERS], skipped


def _entry(entry: object, *, now: float) -> SavedPeer | None:
    if not isinstance(entry, dict):
        return None
    peer_id, addrs, when = entry.get("id"), entry.get("addrs"), entry.get("last_connected")
    if not isinstance(peer_id, str) or not _PEER_ID.match(peer_id) or not _is_peer_id(peer_id):
        return None
    if not isinstance(addrs, list) or not isinstance(when, int | float) or isinstance(when, bool):
        return None
    if not math.isfinite(when) or not now - REMEMBER_FOR_S < when <= now + _FUTURE_SLACK_S:
        return None
    valid = [a for a in addrs[: MAX_SAVED_ADDRS * 2] if isinstance(a, str) and _is_own_addr(a, peer_id)]
    if not valid:
        return None
    return SavedPeer(peer_id, _pick_addrs(valid), float(when))


def _is_peer_id(text: str) -> bool:
    try:
        ID.from_base58(text)
    except Exception:  # noqa: BLE001 - base58 and multihash decoders raise their own kinds
        return False
    return True


def _is_own_addr(addr: str, peer_id: str) -> bool:
    """A dialable TCP address (direct or through a relay) that names ``peer_id`` at its end."""
    if len(addr) > MAX_ADDR_LEN or not addr.endswith(f"/p2p/{peer_id}") or "/tcp/" not in addr:
        return False
    try:
        Multiaddr(addr)
    except Exception:  # noqa: BLE001 - the multiaddr parser raises several kinds for garbage
        return False
    return True


def load_saved_peers(data_dir: Path, *, self_id: str, now: float) -> list[SavedPeer]:
    """The saved members (see the module docstring); ``[]`` with a warning for a bad file."""
    path = data_dir / SAVED_PEERS_FILE
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot read the saved peer book %s (%s): starting without it", path, exc.strerror)
        return []
    if len(raw) > MAX_FILE_BYTES:
        log.warning("saved peer book %s is larger than %d bytes: starting without it", path, MAX_FILE_BYTES)
        return []
    try:
        peers, skipped = decode(raw, self_id=self_id, now=now)
    except ValueError as exc:
        log.warning("saved peer book %s is %s: starting without it", path, exc)
        return []
    if skipped:
        log.warning(
            "saved peer book %s: skipped %d invalid or stale entr%s", path, skipped, "y" if skipped == 1 else "ies",
        )
    return peers


def save_peers(data_dir: Path, peers: Iterable[SavedPeer]) -> None:
    """Replace the saved book atomically (blocking: async callers use a worker thread)."""
    path = data_dir / SAVED_PEERS_FILE
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a temporary left by an older version may be wider
        blob = encode(peers)
        written = 0
        while written < len(blob):
            written += os.write(fd, blob[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
