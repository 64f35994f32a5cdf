"""The peer book saved in the data dir: what is kept, and a hostile or broken file (pure + files)."""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from lattica.net.peerbook import PeerBook
from lattica.net.saved_peers import (
    MAX_FILE_BYTES,
    MAX_SAVED_ADDRS,
    MAX_SAVED_PEERS,
    REMEMBER_FOR_S,
    SAVED_PEERS_FILE,
    SavedPeer,
    decode,
    encode,
    load_saved_peers,
    save_peers,
    saved_from_book,
)

NOW = 1_800_000_000.0


def _pid() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


ME, PEER, RELAY = _pid(), _pid(), _pid()


def _addr(peer: str, port: int = 4001) -> str:
    return f"/ip4/198.51.100.7/tcp/{port}/p2p/{peer}"


def test_only_members_once_connected_are_saved_with_their_own_addresses() -> None:
    book = PeerBook(ME)
    book.set_connected({PEER}, now=NOW)
    book.learn(PEER, [_addr(PEER)], now=NOW)
    book.get(PEER).member = True  # it spoke a Lattica protocol
    book.hear(PEER, [_addr(PEER, 9)], now=NOW)  # a third party's word: not saved
    relay_only = _pid()
    book.set_connected({PEER, relay_only}, now=NOW + 1)
    book.learn(relay_only, [_addr(relay_only)], now=NOW)  # connected, but a plain libp2p node
    never = _pid()
    book.learn(never, [_addr(never)], now=NOW)  # known, never connected
    assert saved_from_book(book.records()) == [SavedPeer(PEER, (_addr(PEER),), NOW + 1)]


def test_a_saved_book_round_trips_and_keeps_the_most_recent_members(tmp_path: Path) -> None:
    peers = [SavedPeer(_pid(), (_addr("x"),), NOW - i) for i in range(3)]
    peers = [SavedPeer(p.peer_id, (_addr(p.peer_id),), p.last_connected) for p in peers]
    save_peers(tmp_path, peers)
    path = tmp_path / SAVED_PEERS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_saved_peers(tmp_path, self_id=ME, now=NOW) == peers
    assert not list(tmp_path.glob("*.tmp"))


def test_saving_over_a_wider_file_leaves_it_private(tmp_path: Path, wide_umask: None) -> None:
    path = tmp_path / SAVED_PEERS_FILE
    path.write_text("{}")
    path.chmod(0o644)
    save_peers(tmp_path, [])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_entries_are_checked_one_by_one() -> None:
    good = {"id": PEER, "addrs": [_addr(PEER)], "last_connected": NOW - 10}
    bad = [
        "not an object",
        {"id": "12D3KooWnot-a-peer-id", "addrs": [_addr(PEER)], "last_connected": NOW},
        {"id": ME, "addrs": [_addr(ME)], "last_connected": NOW},  # ourselves
        {"id": RELAY, "addrs": [_addr(PEER)], "last_connected": NOW},  # an address of another peer
        {"id": RELAY, "addrs": ["/ip4/1.2.3.4/udp/1/p2p/" + RELAY], "last_connected": NOW},
        {"id": RELAY, "addrs": [_addr(RELAY)], "last_connected": NOW + 10 * 86400},  # the future
        {"id": RELAY, "addrs": [_addr(RELAY)], "last_connected": NOW - REMEMBER_FOR_S - 1},  # stale
        {"id": RELAY, "addrs": [_addr(RELAY)], "last_connected": float("nan")},
        {"id": RELAY, "addrs": [_addr(RELAY)], "last_connected": True},
        {"id": RELAY, "addrs": "x", "last_connected": NOW},
        {"id": RELAY, "addrs": ["/ip4/1.2.3.4/tcp/1" + "/ip4/1.2.3.4" * 40 + "/p2p/" + RELAY], "last_connected": NOW},
        good,  # a duplicate
    ]
    raw = json.dumps({"version": 1, "peers": [good, *bad]}).encode()
    peers, skipped = decode(raw, self_id=ME, now=NOW)
    assert peers == [SavedPeer(PEER, (_addr(PEER),), NOW - 10)]
    assert skipped == len(bad)


def test_a_huge_book_is_cut_to_its_bounds() -> None:
    many = [
        {"id": pid, "addrs": [_addr(pid, port) for port in range(1, 30)], "last_connected": NOW - i}
        for i, pid in enumerate(_pid() for _ in range(MAX_SAVED_PEERS + 20))
    ]
    peers, skipped = decode(json.dumps({"version": 1, "peers": many}).encode(), self_id=ME, now=NOW)
    assert len(peers) == MAX_SAVED_PEERS
    assert skipped == 20
    assert all(len(p.addrs) == MAX_SAVED_ADDRS for p in peers)
    assert [p.last_connected for p in peers] == sorted((p.last_connected for p in peers), reverse=True)


@pytest.mark.parametrize(
    "content",
    [b"", b"\xff\xfe garbage", b"[]", b'{"version": 2, "peers": []}', b'{"version": 1, "peers": {}}',
     b"[" * 100_000, b" " * (MAX_FILE_BYTES + 1)],
)
def test_a_broken_file_is_ignored_with_one_warning(tmp_path: Path, content: bytes, caplog) -> None:
    (tmp_path / SAVED_PEERS_FILE).write_bytes(content)
    assert load_saved_peers(tmp_path, self_id=ME, now=NOW) == []
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    assert SAVED_PEERS_FILE in caplog.text


def test_no_file_is_no_book(tmp_path: Path) -> None:
    assert load_saved_peers(tmp_path, self_id=ME, now=NOW) == []


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=30,
))
def test_any_json_decodes_or_fails_with_value_error(obj: object) -> None:
    raw = json.dumps({"version": 1, "peers": obj if isinstance(obj, list) else [obj]}).encode()
    peers, _ = decode(raw, self_id=ME, now=NOW)
    assert all(isinstance(p, SavedPeer) for p in peers)
    with contextlib.suppress(ValueError):
        decode(json.dumps(obj).encode(), self_id=ME, now=NOW)


def test_encode_is_what_decode_reads() -> None:
    peers = [SavedPeer(PEER, (_addr(PEER), f"/ip4/198.51.100.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"), NOW)]
    assert decode(encode(peers), self_id=ME, now=NOW) == (peers, 0)
