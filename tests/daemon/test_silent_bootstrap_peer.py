"""A bootstrap peer that does not answer does not hold start-up once another one answered.

A restarted member is given every other member as ``--peer``; one of them may be down or cut
off. Real ``lattica join`` processes on loopback: a member, and a joiner given the member and a
silent address (a TCP port that accepts connections and never says anything, as a host whose
link was cut looks to a dial in progress). Before, start-up waited for every bootstrap dial to
end, so the joiner was up only after the silent one timed out (5 s).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.net.identity import peer_id_of
from lattica_lab.daemons import DaemonProcess, wait_for

UP = "is up (run"


@pytest.fixture
def silent_addr() -> Iterator[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes handshakes; nothing is ever read or sent
        peer_id = peer_id_of(create_new_key_pair()).to_base58()
        yield f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{peer_id}"


def test_start_up_does_not_wait_for_a_silent_bootstrap_peer(tmp_path: Path, silent_addr: str) -> None:
    member = DaemonProcess(tmp_path / "member")
    joiner: DaemonProcess | None = None
    try:
        member.start().wait_ready(60)
        peers = (silent_addr, member.addr)
        joiner = DaemonProcess(tmp_path / "joiner", peers=peers, extra_args=("--log-level", "info"))
        joiner.start().wait_ready(60)
        assert wait_for(lambda: UP in joiner.log(), 60), joiner.log()
        before_up = joiner.log().split(UP)[0]
        assert "joined run 'default' through 1 member(s)" in joiner.log(), joiner.log()
        assert f"cannot reach bootstrap peer {silent_addr}" not in before_up, joiner.log()
    finally:
        if joiner is not None:
            joiner.kill()
        member.kill()
