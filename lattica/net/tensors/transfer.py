"""``TensorService``: moves named tensors between peers, and is the node's ``Collective``.

Theory of operation
-------------------
Sending a message (``frames.py``) to a peer takes the fast channel (``fastpath.py``) when the
peer is directly dialable, else a fresh libp2p stream on ``TENSOR_PROTOCOL`` (which also works
relayed or hole-punched). A fast channel is set up lazily on first use; if the dial fails the
peer is marked not directly dialable for ``fast_retry_s`` and libp2p streams carry its traffic.
The setup handshake of a fast channel (both sides) is in ``fast_setup.py``; a libp2p stream is
read and written as a channel through ``streams.StreamChannel``.

Every incoming stream or channel gets a reader (``receiving.MessageReader``) that drains it
promptly into buffers reserved in the ``MemoryBudget`` (so a slow consumer never stalls yamux),
and delivers complete ``put`` messages to the ``Mailbox`` under ``(tag, sender, part)``. ``fetch``
requests are answered with
a ``put`` from the locally served tensors — each named tensor once, within the ``FetchGate``'s
ration (``limits.py``): a peer cannot make us send more than a few copies at a time, nor the same
content again within ``fetch_repeat_s``.

The fast channel is dialed only at the IP address the peer's live, direct libp2p connection
comes from, at the port the peer names: a peer can point us at a port of its own machine, never
at another host (a relayed connection gets no fast channel).

Failure handling: any ``RemoteProtocolError`` from a peer (malformed frame, failed AEAD tag,
duplicate part, truncated message) drops the peer — its channels are closed, it is disconnected
and refused for ``ban_s`` — and is counted in ``stats.protocol_errors``. A send that fails or a
sender that disappears while awaited is a ``PeerUnavailableError``. Aborted sends reset their
stream / close their channel so the receiver sees a broken transfer, never a half message.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from trio_typing import TaskStatus

from lattica.errors import (
    BrokenError,
    LocalProtocolError,
    PeerUnavailableError,
    RemoteProtocolError,
)
from lattica.net.identity import peer_id_of
from lattica.net.streams import close_quietly, reset_quietly
from lattica.net.tensors import collectives, fast_setup, fastpath, frames
from lattica.net.tensors.limits import (
    FetchAnswer,
    FetchGate,
    MemoryBudget,
    ScratchPool,
    TensorLimits,
)
from lattica.net.tensors.mailbox import Mailbox
from lattica.net.tensors.receiving import MessageReader
from lattica.net.tensors.stats import TrafficStats
from lattica.net.tensors.streams import StreamChannel
from lattica.net.wire import read_message, write_message
from lattica.numerics import codecs
from lattica.numerics.screen import DEFAULT_SCREEN, ContributionScreen, Rejection

log = logging.getLogger(__name__)

TENSOR_PROTOCOL = "/lattica/tensors/1.0.0"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorServiceConfig:
    fast_path: bool = True
    fast_bind_host: str | None = None  # None: the libp2p listen interface
    fast_port: int = 0  # 0: ephemeral
    fast_connections: int = 1
    fast_frame_bytes: int = 4 << 20
    fast_connect_timeout_s: float = 3.0
    fast_retry_s: float = 60.0
    stream_chunk_bytes: int = 1 << 20
    ban_s: float = 60.0
    limits: TensorLimits = field(default_factory=TensorLimits)
    screen: ContributionScreen = DEFAULT_SCREEN

    def __post_init__(self) -> None:
        if not 0 <= self.fast_port <= 65535:
            raise ValueError("fast_port must be between 0 and 65535")
        if not 1 <= self.fast_connections <= 16:
            raise ValueError("fast_connections must be between 1 and 16")
        if not 4096 <= self.fast_frame_bytes <= 64 << 20:
            raise ValueError("fast_frame_bytes must be between 4 KiB and 64 MiB")
        if not 4096 <= self.stream_chunk_bytes <= 16 << 20:
            raise ValueError("stream_chunk_bytes must be between 4 KiB and 16 MiB")
        if self.fast_connect_timeout_s <= 0 or self.fast_retry_s < 0 or self.ban_s < 0:
            raise ValueError("timeouts must be positive")


class TensorService:
    """The data plane of one node. Start with ``await nursery.start(service.run)``."""

    def __init__(self, host: IHost, key_pair: KeyPair, *, config: TensorServiceConfig) -> None:
        self._host = host
        self._peer_id = str(peer_id_of(key_pair))
        self.config = config
        self.stats = TrafficStats()
        self.budget = MemoryBudget(config.limits)
        self.mailbox = Mailbox(self.budget, ttl_s=config.limits.mailbox_ttl_s)
        self.scratch = ScratchPool(config.limits.scratch_pool_bytes)
        self._reader = MessageReader(
            limits=config.limits, budget=self.budget, mailbox=self.mailbox, stats=self.stats,
            on_fetch=self._start_fetch_answer,
        )
        self.fast_port: int | None = None
        self._served: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, version)
        self._serve_version = 0
        self.fetch_gate = FetchGate(config.limits)
        self._fetch_slots = trio.Semaphore(config.limits.max_fetch_serves)
        self._channels: dict[str, list[fastpath.FastChannel]] = {}
        self._no_fast_until: dict[str, float] = {}
        self._dial_locks: dict[str, trio.Lock] = {}
        self._pending = fast_setup.PendingSessions()
        self._banned_until: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                if self.config.fast_path:
                    bind = self.config.fast_bind_host or fast_setup.listen_host(self._host)
                    listeners = await trio.open_tcp_listeners(self.config.fast_port, host=bind)
                    self.fast_port = listeners[0].socket.getsockname()[1]
                    nursery.start_soon(trio.serve_listeners, self._accept_fast, listeners)
                self._host.set_stream_handler(TProtocol(TENSOR_PROTOCOL), self._handle_stream)
                self._host.set_stream_handler(TProtocol(fastpath.FAST_PROTOCOL), self._handle_fast_setup)
                task_status.started()
                await trio.sleep_forever()
            finally:
                for channels in self._channels.values():
                    for channel in channels:
                        channel.close()
                self._nursery = None

    # -- collectives and named tensors (the public surface) --------------------------------------

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32",
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The mean over ``group``, new or written into ``out`` (see ``collectives.allreduce``)."""
        return await collectives.allreduce(
            self, tensors, group=group, tag=tag, codec=codec, screen=self.config.screen,
            on_reject=self.score_down, out=out,
        )

    def score_down(self, rejection: Rejection) -> None:
        """A contribution was excluded — by this member reducing an all-reduce part, or by the
        strategy screening what a group partner sent: count it against the peer."""
        self.stats.rejected_contributions[rejection.peer] += 1
        log.warning("excluded %s's contribution: %s", rejection.peer, rejection.reason)

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        return await collectives.exchange(self, tensors, peer=peer, tag=tag, codec=codec)

    def serve(self, name: str, tensor: torch.Tensor) -> None:
        """Offer ``tensor`` to ``fetch`` under ``name`` (the caller must not mutate it in place)."""
        codecs.spec_of(tensor, "raw", name)
        self._serve_version += 1
        self._served[name] = (tensor.detach(), self._serve_version)

    def unserve(self, name: str) -> None:
        self._served.pop(name, None)

    async def fetch(self, peer: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Bit-exact copies of the tensors ``peer`` serves under ``names``."""
        tag = "fetch/" + os.urandom(8).hex()
        await self._send_frame(peer, frames.encode_fetch(tag, list(names)), [])
        got = await self.receive(peer, tag)
        by_name = dict(got)
        missing = [n for n in names if n not in by_name]
        if missing:
            raise PeerUnavailableError(f"peer does not serve {missing} or is busy", peer_id=peer)
        return {n: by_name[n] for n in names}

    # -- point to point ----------------------------------------------------------------------

    async def send(
        self, peer: str, tag: str, tensors: Sequence[torch.Tensor], *, codec: str = "fp32",
        part: int = 0, names: Sequence[str] | None = None,
    ) -> None:
        names = list(names) if names is not None else [""] * len(tensors)
        encoded = [codecs.encode(t, codec, n) for t, n in zip(tensors, names, strict=True)]
        header = frames.encode_put(tag, part, [spec for spec, _ in encoded])
        await self._send_frame(peer, header, [payload for _, payload in encoded])

    async def receive(self, peer: str, tag: str, *, part: int = 0) -> list[tuple[str, torch.Tensor]]:
        """Wait for ``(tag, peer, part)``; returns ``(name, tensor)`` pairs in sent order."""
        parcel = await self.mailbox.take((tag, peer, part), alive=self.is_alive)
        out, offset = [], 0
        try:
            for spec in parcel.specs:
                chunk = memoryview(parcel.payload)[offset : offset + spec.payload_size]
                out.append((spec.name, codecs.decode(spec, chunk, peer_id=peer)))
                offset += spec.payload_size
        except RemoteProtocolError as exc:
            await self._drop(peer, exc)
            raise
        return out

    def post_receive(
        self, peer: str, tag: str, part: int, buffer: memoryview | None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Let ``(tag, peer, part)`` land directly in ``buffer`` (None: withdraw the offer).

        Only the payload bytes go there; ``receive`` still validates the header, and a tensor
        it returns may share memory with ``buffer``. ``on_progress(nbytes)``, called on the
        reading task, tells how much of the buffer is already written while it arrives.
        """
        if buffer is None:
            self.mailbox.unpost((tag, peer, part))
        else:
            self.mailbox.post((tag, peer, part), buffer, on_progress)

    def lease_scratch(self, nbytes: int) -> AbstractContextManager[torch.Tensor]:
        """A context manager lending a uint8 buffer of ``nbytes`` (see ``ScratchPool``)."""
        return self.scratch.lease(nbytes)

    def discard_tag(self, tag: str) -> None:
        """Drop parts of an abandoned operation that arrived or will not be taken."""
        self.mailbox.discard(lambda key: key[0] == tag)

    def is_alive(self, peer: str) -> bool:
        if self._banned_until.get(peer, 0.0) > trio.current_time():
            return False
        if any(not c.closed for c in self._channels.get(peer, [])):
            return True
        try:
            return bool(self._host.get_network().get_connections(ID.from_base58(peer)))
        except ValueError:
            return False

    # -- sending -----------------------------------------------------------------------------

    async def _send_frame(self, peer: str, header: bytes, payloads: list[memoryview]) -> None:
        if peer == self._peer_id:
            raise LocalProtocolError("cannot send tensors to ourselves")
        size = len(header) + sum(len(p) for p in payloads)
        started = trio.current_time()
        channel = await self._fast_channel(peer)
        retried = False
        while channel is not None:
            pieces: tuple[bytes | memoryview, ...] = (header, *payloads)
            async with channel.send_lock:
                before = channel.bytes_out
                try:
                    for piece in pieces:
                        await channel.send_all(piece)
                except BaseException as exc:
                    channel.abort()  # never leave half a message on a channel
                    self.mailbox.peer_lost(peer)
                    if not isinstance(exc, BrokenError):
                        raise
                    if retried or channel.bytes_out != before:
                        raise PeerUnavailableError(str(exc), peer_id=peer) from None
                    # the channel had died before any byte of this message left (the peer
                    # reset it while it was idle): nothing to undo, so one fresh channel
                    log.info("fast channel to %s was dead before a send (%r); sending on a new one", peer, exc)
                    retried = True
                    channel = await self._fast_channel(peer)
                    continue
            self._count_sent(peer, "fast", size)
            self.stats.note_transfer(peer, size, trio.current_time() - started)
            return
        await self._send_on_stream(peer, header, payloads)
        self._count_sent(peer, "libp2p", size)
        self.stats.note_transfer(peer, size, trio.current_time() - started)

    async def _send_on_stream(self, peer: str, header: bytes, payloads: list[memoryview]) -> None:
        try:
            stream = await self._host.new_stream(ID.from_base58(peer), [TProtocol(TENSOR_PROTOCOL)])
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds when a stream cannot be opened
            raise PeerUnavailableError(f"cannot open a tensor stream: {exc!r}", peer_id=peer) from None
        channel = StreamChannel(stream, peer, self.config.stream_chunk_bytes)
        pieces: tuple[bytes | memoryview, ...] = (header, *payloads)
        try:
            for piece in pieces:
                await channel.send_all(piece)
            await stream.close()
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await reset_quietly(stream)
            if isinstance(exc, BrokenError):
                raise PeerUnavailableError(str(exc), peer_id=peer) from None
            raise

    def _count_sent(self, peer: str, path: str, size: int) -> None:
        self.stats.bytes_sent[(peer, path)] += size
        self.stats.messages_sent[(peer, path)] += 1

    async def _fast_channel(self, peer: str) -> fastpath.FastChannel | None:
        if not self.config.fast_path:
            return None
        channels = self._open_channels(peer)
        if len(channels) >= self.config.fast_connections:
            return fast_setup.least_busy(channels)
        if self._no_fast_until.get(peer, 0.0) > trio.current_time():
            return fast_setup.least_busy(channels) if channels else None
        lock = self._dial_locks.setdefault(peer, trio.Lock())
        async with lock:
            channels = self._open_channels(peer)
            if len(channels) >= self.config.fast_connections or any(
                not c.send_lock.locked() for c in channels
            ):
                return fast_setup.least_busy(channels)
            try:
                with trio.fail_after(self.config.fast_connect_timeout_s):
                    channel = await self._dial_fast(peer)
            except (trio.TooSlowError, OSError, BrokenError, RemoteProtocolError) as exc:
                log.info("fast path to %s unavailable (%r); using libp2p streams", peer, exc)
                self._no_fast_until[peer] = trio.current_time() + self.config.fast_retry_s
                return fast_setup.least_busy(channels) if channels else None
            self._register(channel)
            return channel

    def _open_channels(self, peer: str) -> list[fastpath.FastChannel]:
        channels = [c for c in self._channels.get(peer, []) if not c.closed]
        self._channels[peer] = channels
        return channels

    async def _dial_fast(self, peer: str) -> fastpath.FastChannel:
        return await fast_setup.dial(self._host, peer, self._peer_id, frame_bytes=self.config.fast_frame_bytes)

    def _register(self, channel: fastpath.FastChannel) -> None:
        self._channels.setdefault(channel.peer_id, []).append(channel)
        assert self._nursery is not None, "TensorService.run() is not running"
        self._nursery.start_soon(self._serve_channel, channel)

    # -- receiving ---------------------------------------------------------------------------

    async def _handle_stream(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if self._is_banned(peer):
            await reset_quietly(stream)
            return
        channel = StreamChannel(stream, peer, self.config.stream_chunk_bytes)
        try:
            await self._read_messages(channel, peer, "libp2p")
        except RemoteProtocolError as exc:
            await reset_quietly(stream)
            await self._drop(peer, exc)
        except BrokenError:
            await reset_quietly(stream)
        else:
            await close_quietly(stream)

    async def _serve_channel(self, channel: fastpath.FastChannel) -> None:
        peer = channel.peer_id
        try:
            await self._read_messages(channel, peer, "fast")
        except RemoteProtocolError as exc:
            channel.close()
            await self._drop(peer, exc)
        except BrokenError:
            pass
        finally:
            channel.close()
            self.mailbox.peer_lost(peer)

    async def _read_messages(self, channel: StreamChannel | fastpath.FastChannel, peer: str, path: str) -> None:
        await self._reader.read(channel, peer, path)

    def _start_fetch_answer(self, peer: str, request: frames.Incoming) -> None:
        """Answer a fetch within the gate's ration: the tensors as they are now, each once."""
        names = [n for n in dict.fromkeys(request.names) if n in self._served]
        content = tuple((n, self._served[n][1]) for n in names)
        nbytes = sum(self._served[n][0].numel() * self._served[n][0].element_size() for n in names)
        answer = self.fetch_gate.request(peer, content, trio.current_time(), nbytes=nbytes)
        if answer is FetchAnswer.DROP:
            log.debug("dropped a fetch from %s: a refusal is still on its way", peer)
            return
        if answer is FetchAnswer.REFUSE and content:
            log.info(
                "refused a fetch of %d tensor(s) from %s: too many or repeated, or the node's serving budget is spent",
                len(names), peer,
            )
        tensors = [self._served[n][0] for n in names] if answer is FetchAnswer.SERVE else []
        names = names if answer is FetchAnswer.SERVE else []
        assert self._nursery is not None, "TensorService.run() is not running"
        self._nursery.start_soon(self._answer_fetch, peer, request.tag, names, tensors, answer, content)

    async def _answer_fetch(
        self, peer: str, tag: str, names: list[str], tensors: list[torch.Tensor], answer: FetchAnswer,
        content: tuple[tuple[str, int], ...],
    ) -> None:
        try:
            if answer is FetchAnswer.SERVE:
                async with self._fetch_slots:  # the node-wide cap: later answers wait their turn
                    await self.send(peer, tag, tensors, codec="raw", names=names)
            else:
                await self.send(peer, tag, [], codec="raw", names=[])
        except (PeerUnavailableError, BrokenError) as exc:
            log.info("could not answer a fetch from %s: %s", peer, exc)
        finally:
            self.fetch_gate.done(peer, answer, content, trio.current_time())

    # -- fast path setup (responder side) ------------------------------------------------------

    async def _handle_fast_setup(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            request = await read_message(stream, max_size=fast_setup.MAX_SETUP_MESSAGE, peer_id=peer)
            their_nonce = fast_setup.setup_nonce(request, peer)
            if self.fast_port is None or self._is_banned(peer):
                await write_message(stream, {"err": "no fast path"}, peer_id=peer)
                return
            reply = self._pending.offer(peer, their_nonce, self._peer_id, self.fast_port, trio.current_time())
            await write_message(stream, reply, peer_id=peer)
        except RemoteProtocolError as exc:
            await self._drop(peer, exc)
        except BrokenError:
            pass
        finally:
            await close_quietly(stream)

    async def _accept_fast(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = None
        try:
            with trio.move_on_after(fastpath.PENDING_TTL_S):
                session = self._pending.claim(await fastpath.read_session_id(sock), trio.current_time())
                if session is None:
                    return
                peer, k_out, k_in = session
                channel = fastpath.FastChannel(
                    sock, send_key=k_out, recv_key=k_in, peer_id=peer,
                    frame_bytes=self.config.fast_frame_bytes,
                )
                await channel.expect_hello()
        except (RemoteProtocolError, BrokenError, OSError) as exc:
            log.info("rejected a fast path connection: %r", exc)
            channel = None
        finally:
            if channel is None or channel.closed:
                sock.close()
        if channel is None or channel.closed:
            return
        self._channels.setdefault(channel.peer_id, []).append(channel)
        await self._serve_channel(channel)

    # -- dropping misbehaving peers -------------------------------------------------------------

    def _is_banned(self, peer: str) -> bool:
        return self._banned_until.get(peer, 0.0) > trio.current_time()

    async def _drop(self, peer: str, exc: RemoteProtocolError) -> None:
        log.warning("dropping peer %s: %s", peer, exc)
        self.stats.protocol_errors[peer] += 1
        self._banned_until[peer] = trio.current_time() + self.config.ban_s
        for channel in self._channels.pop(peer, []):
            channel.close()
        self.mailbox.discard(lambda key: key[1] == peer)
        self.mailbox.peer_lost(peer)
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await self._host.disconnect(ID.from_base58(peer))
            except Exception as err:  # noqa: BLE001 - best effort on the way out; libp2p raises many kinds
                log.debug("disconnect from %s failed: %r", peer, err)
