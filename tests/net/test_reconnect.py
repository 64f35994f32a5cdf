"""Whom the reconnector dials, and when (a fake dialer, trio's autojump clock)."""

from __future__ import annotations

import time
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from lattica.net.peerbook import PeerBook
from lattica.net.reconnect import Reconnector
from lattica.net.redial import RedialPolicy
from lattica.net.saved_peers import SAVED_PEERS_FILE, SavedPeer, save_peers

MEMBERS = [ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(41)]
BOOT = MEMBERS[40]


def _member(i: int) -> str:
    return MEMBERS[i]


class FakeDialer:
    """Records every dial (at trio's clock); a peer in ``answers`` connects when dialed."""

    def __init__(self) -> None:
        self.connected: set[str] = set()
        self.answers: set[str] = set()
        self.dials: list[tuple[float, str]] = []

    def connected_ids(self) -> set[str]:
        return set(self.connected)

    def is_dialing(self, peer_id: str) -> bool:
        return False

    async def dial_bootstrap(self, addr: str) -> bool:
        return await self.dial_known(addr.rsplit("/p2p/", 1)[-1], [addr])

    async def dial_known(self, peer_id: str, addrs: list[str]) -> bool:
        self.dials.append((round(trio.current_time(), 1), peer_id))
        if peer_id in self.answers:
            self.connected.add(peer_id)
        return peer_id in self.connected

    def times(self, peer_id: str) -> list[float]:
        return [t for t, p in self.dials if p == peer_id]


def _book(tmp_path: Path, *members: str, left: tuple[str, ...] = ()) -> PeerBook:
    book = PeerBook("me")
    book.learn(BOOT, [f"/ip4/10.0.0.9/tcp/4001/p2p/{BOOT}"], now=1.0, bootstrap=True)
    for peer in members:
        book.remember(peer, [f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}"], last_connected=1.0, now=1.0)
        if peer in left:
            book.mark_left(peer, now=1.0)
    return book


def _reconnector(tmp_path: Path, book: PeerBook, dialer: FakeDialer, **kwargs) -> Reconnector:
    return Reconnector(
        book, dialer=dialer, data_dir=tmp_path, bootstrap={BOOT: [f"/ip4/10.0.0.9/tcp/4001/p2p/{BOOT}"]},
        policy=RedialPolicy(max_pause_s=8.0, left_max_pause_s=20.0), **kwargs,
    )


async def test_lost_members_left_members_and_bootstrap_peers_each_at_their_pace(tmp_path: Path, autojump_clock) -> None:
    lost, leaving = _member(1), _member(2)
    dialer = FakeDialer()
    reconnector = _reconnector(tmp_path, _book(tmp_path, lost, leaving, left=(leaving,)), dialer, forget_after_s=30.0)
    start = trio.current_time()
    with trio.move_on_after(60):
        await reconnector.run()

    def since(t: float) -> float:
        return round(t - start, 1)

    assert [since(t) for t in dialer.times(lost)] == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0]  # then forgotten (30 s)
    assert [since(t) for t in dialer.times(leaving)] == [5.0, 10.0, 20.0]  # said goodbye: slower, then forgotten
    assert [since(t) for t in dialer.times(BOOT)] == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0, 47.0, 55.0]


async def test_a_member_that_answers_is_no_longer_dialed(tmp_path: Path, autojump_clock) -> None:
    back = _member(1)
    dialer = FakeDialer()
    dialer.answers.add(back)
    reconnector = _reconnector(tmp_path, _book(tmp_path, back), dialer)
    with trio.move_on_after(10):
        await reconnector.run()
    assert len(dialer.times(back)) == 1


async def test_at_most_16_dials_start_per_tick(tmp_path: Path, autojump_clock) -> None:
    dialer = FakeDialer()
    reconnector = _reconnector(tmp_path, _book(tmp_path, *(_member(i) for i in range(40))), dialer)
    with trio.move_on_after(0.1):
        await reconnector.run()
    assert len(dialer.dials) == 16


async def test_a_restarted_node_waits_for_a_remembered_member_only_until_one_answers(
    tmp_path: Path, autojump_clock,
) -> None:
    save_peers(
        tmp_path,
        [SavedPeer(_member(i), (f"/ip4/10.0.0.1/tcp/4001/p2p/{_member(i)}",), time.time() - 100 + i) for i in range(3)],
    )
    dialer = FakeDialer()
    dialer.answers.add(_member(1))
    book = PeerBook("me")
    reconnector = Reconnector(book, dialer=dialer, data_dir=tmp_path, bootstrap={}, policy=RedialPolicy())
    assert reconnector.restore() == 3
    assert await reconnector.reach_remembered(wait_s=5.0) == 1
    nobody = Reconnector(PeerBook("me"), dialer=FakeDialer(), data_dir=tmp_path, bootstrap={}, policy=RedialPolicy())
    nobody.restore()
    started = trio.current_time()
    assert await nobody.reach_remembered(wait_s=5.0) == 0
    assert trio.current_time() - started < 5.0  # every dial failed: no need to wait longer


async def test_the_book_is_saved_when_it_changed(tmp_path: Path, autojump_clock) -> None:
    book = PeerBook("me")
    reconnector = Reconnector(book, dialer=FakeDialer(), data_dir=tmp_path, bootstrap={}, policy=RedialPolicy())
    await reconnector.save()
    assert (tmp_path / SAVED_PEERS_FILE).read_text().count('"id"') == 0
    book.set_connected({_member(1)}, now=5.0)
    book.learn(_member(1), [f"/ip4/10.0.0.1/tcp/4001/p2p/{_member(1)}"], now=5.0)
    book.get(_member(1)).member = True
    await reconnector.save()
    assert (tmp_path / SAVED_PEERS_FILE).read_text().count('"id"') == 1
