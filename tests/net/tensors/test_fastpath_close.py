"""A fast channel closed by one task while another reads or writes on it fails as broken.

Under churn the data plane closes a peer's channels (a protocol error, a lost peer) while its
reader task is parked in ``recv_into``; trio then raises ``ClosedResourceError`` in that task,
which must surface as ``BrokenError`` like any other dead channel — not escape and stop the node.
"""

from __future__ import annotations

import pytest
import trio

from lattica.errors import BrokenError
from lattica.net.tensors.fastpath import FastChannel

KEY_A, KEY_B = bytes(32), bytes(range(32))


def _pair() -> tuple[FastChannel, FastChannel]:
    a, b = trio.socket.socketpair()
    left = FastChannel(a, send_key=KEY_A, recv_key=KEY_B, peer_id="b", frame_bytes=1024)
    right = FastChannel(b, send_key=KEY_B, recv_key=KEY_A, peer_id="a", frame_bytes=1024)
    return left, right


async def test_a_reader_parked_on_a_channel_closed_by_another_task_gets_broken_error() -> None:
    left, right = _pair()
    failures: list[BaseException] = []

    async def read() -> None:
        try:
            await left.receive_some()
        except BrokenError as exc:
            failures.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.sleep(0.1)  # the reader is waiting for data
            left.close()
    assert len(failures) == 1
    assert left.closed
    right.close()


async def test_sending_on_a_closed_channel_is_broken_and_close_is_idempotent() -> None:
    left, right = _pair()
    await left.send_all(b"hello")
    assert bytes(await right.receive_some()) == b"hello"
    left.close()
    left.close()
    with pytest.raises(BrokenError):
        await left.send_all(b"again")
    right.close()
