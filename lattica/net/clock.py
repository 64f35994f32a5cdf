"""Clock skew against a peer (``/lattica/clock/1.0.0``), as ``lattica doctor`` measures it.

Theory of operation: the asker opens a stream and sends an empty message; the answerer
replies ``{"t": <its wall clock, seconds since the epoch>}`` and closes. The asker notes its
own wall clock when it sent (``t0``) and when the answer arrived (``t1``); assuming the answer
was taken half way, the peer's clock is ahead by ``t - (t0 + t1) / 2``, give or take half the
round trip. ``clock_offset`` is that arithmetic, pure. A malformed answer is a
``RemoteProtocolError`` naming the peer; a peer that does not speak the protocol (an older
version, a plain libp2p node) just has no figure.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from lattica.errors import RemoteProtocolError
from lattica.net.wire import read_message, write_message

log = logging.getLogger(__name__)

CLOCK_PROTOCOL = TProtocol("/lattica/clock/1.0.0")
_CLOCK_BUDGET_S = 3.0
_MAX_MESSAGE = 256


@dataclass(frozen=True)
class ClockOffset:
    """How far the peer's clock is ahead of ours (negative: behind), and the uncertainty."""

    offset_s: float
    error_s: float


def clock_offset(sent_at: float, peer_time: float, received_at: float) -> ClockOffset:
    if received_at < sent_at:
        raise ValueError("the answer arrived before the question was sent (our clock jumped)")
    rtt = received_at - sent_at
    return ClockOffset(offset_s=peer_time - (sent_at + rtt / 2), error_s=rtt / 2)


def peer_time_from(reply: object, peer_id: str) -> float:
    """The peer's clock from its answer; anything but a finite positive number is refused."""
    value = reply.get("t") if isinstance(reply, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise RemoteProtocolError("clock answer without a valid time", peer_id=peer_id)
    return float(value)


async def answer_clock(stream: INetStream) -> None:
    """The handler: read the (empty) question, answer with our wall clock. A broken or
    hostile asker costs its own stream only."""
    peer_id = stream.muxed_conn.peer_id.to_base58()
    try:
        await read_message(stream, max_size=_MAX_MESSAGE, peer_id=peer_id)
        await write_message(stream, {"t": time.time()}, peer_id=peer_id)
    except Exception as exc:  # noqa: BLE001
        log.debug("clock query from %s failed: %r", peer_id, exc)
    finally:
        await stream.close()


async def ask_clock(host: IHost, peer_id: str) -> ClockOffset:
    """One measurement against a connected peer; callers bound it in time."""
    stream = await host.new_stream(ID.from_base58(peer_id), [CLOCK_PROTOCOL])
    try:
        sent_at = time.time()
        await write_message(stream, {}, peer_id=peer_id)
        reply = await read_message(stream, max_size=_MAX_MESSAGE, peer_id=peer_id)
        received_at = time.time()
    finally:
        await stream.close()
    return clock_offset(sent_at, peer_time_from(reply, peer_id), received_at)


async def measure_clocks(host: IHost, peer_ids: list[str]) -> dict[str, ClockOffset]:
    """One clock query per peer, all at once, within ``_CLOCK_BUDGET_S``; silent peers are left out."""
    results: dict[str, ClockOffset] = {}

    async def one(peer_id: str) -> None:
        try:
            results[peer_id] = await ask_clock(host, peer_id)
        except Exception as exc:  # noqa: BLE001 - an older peer, a denied stream: no figure
            log.debug("clock query to %s failed: %r", peer_id, exc)

    with trio.move_on_after(_CLOCK_BUDGET_S):
        async with trio.open_nursery() as nursery:
            for peer_id in peer_ids:
                nursery.start_soon(one, peer_id)
    return results
