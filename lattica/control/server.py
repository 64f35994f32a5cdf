"""The daemon side of the control socket (see ``protocol`` for the wire format).

Theory of operation: every accepted connection is one task in the server's nursery and owns
nothing but itself. Whatever a client does — connect and hang up (the "is a daemon running
here?" probe of a second ``lattica join``), send garbage, an oversized or truncated line, stall,
trickle bytes, or go away before reading the reply — ends that connection only; it is logged at
debug level and never reaches the daemon's nursery. Each client gets ``READ_TIMEOUT_S`` for its
request line (at most ``MAX_REQUEST_BYTES``), ``HANDLER_TIMEOUT_S`` for the answer and
``WRITE_TIMEOUT_S`` to take it. At most ``MAX_CLIENTS`` are served at once; when all are taken,
a new client displaces the one that has waited longest for its own request line (a real client
sends it at once, so slow or silent ones cannot lock ``lattica stop`` out), and only when every
client is past its request does the newcomer get a "busy" reply.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from trio_typing import TaskStatus

from lattica.client_slots import ClientSlots
from lattica.control.protocol import (
    MAX_REQUEST_BYTES,
    BadRequest,
    ControlRequest,
    decode_request,
    encode_response,
)
from lattica.errors import ConfigError, LatticaError

log = logging.getLogger(__name__)

Handler = Callable[[ControlRequest], Awaitable[object]]  # the result, sent back as JSON
READ_TIMEOUT_S = 5.0
HANDLER_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
MAX_CLIENTS = 32


class ControlServer:
    def __init__(self, path: Path, handler: Handler, *, max_clients: int = MAX_CLIENTS) -> None:
        self.path = path
        self._handler = handler
        self._slots = ClientSlots(max_clients)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = await self._listen()
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve_guarded, stream)
        finally:
            self.path.unlink(missing_ok=True)
            listener.socket.close()

    async def _listen(self) -> trio.SocketListener:
        await ensure_no_daemon(self.path)
        self.path.unlink(missing_ok=True)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot create control socket {self.path}: {exc.strerror or exc}") from None
        finally:
            os.umask(old_umask)
        sock.listen(16)
        return trio.SocketListener(sock)

    async def _serve_guarded(self, stream: trio.SocketStream) -> None:
        """One client, start to end; nothing it does escapes this function."""
        try:
            async with stream:
                if not self._slots.take():
                    await _reply(stream, encode_response(error="daemon busy: too many control clients"))
                    return
                try:
                    await self._serve_one(stream)
                finally:
                    self._slots.give_back()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("control client went away: %r", exc)
        except Exception:  # a bug here must cost one connection, not the daemon
            log.exception("control connection failed")

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        line = None
        try:
            with trio.move_on_after(READ_TIMEOUT_S) as scope, self._slots.reading(scope):
                line = await _read_line(stream)
            if line is None:
                if trio.current_time() < scope.deadline:
                    return  # displaced by a newer client before its time was up
                await _reply(stream, encode_response(error=f"no request line within {READ_TIMEOUT_S:g} s"))
                return
            if not line.strip():
                return  # connected and hung up (or sent nothing): a liveness probe
            request = decode_request(line)
        except BadRequest as exc:
            await _reply(stream, encode_response(error=str(exc)))
            return
        await _reply(stream, await self._answer(request))

    async def _answer(self, request: ControlRequest) -> bytes:
        try:
            with trio.fail_after(HANDLER_TIMEOUT_S):
                result = await self._handler(request)
            return encode_response(result=result)
        except trio.TooSlowError:
            return encode_response(error=f"{request.method!r} did not finish within {HANDLER_TIMEOUT_S:g} s")
        except LatticaError as exc:
            return encode_response(error=str(exc))
        except Exception as exc:  # a bug in a handler must not kill the daemon
            log.exception("control request %s failed", request.method)
            return encode_response(error=f"internal error: {exc!r}")


async def _reply(stream: trio.SocketStream, data: bytes) -> None:
    with trio.move_on_after(WRITE_TIMEOUT_S):
        await stream.send_all(data)


async def _read_line(stream: trio.SocketStream) -> bytes:
    """The first line the client sends (without its newline), or all it sent before EOF."""
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
        if b"\n" not in buf and len(buf) > MAX_REQUEST_BYTES:
            raise BadRequest(f"request larger than {MAX_REQUEST_BYTES} bytes")
    return bytes(buf.split(b"\n", 1)[0])


async def ensure_no_daemon(path: Path) -> None:
    """Raise ``ConfigError`` when a daemon answers on the control socket ``path``.

    The probe connects and hangs up without a request, which a daemon ignores.
    """
    if await _socket_answers(path):
        raise ConfigError(f"another daemon is already running with data dir {path.parent}")


async def _socket_answers(path: Path) -> bool:
    try:
        with trio.move_on_after(1.0):
            stream = await trio.open_unix_socket(str(path))
            await stream.aclose()
            return True
    except OSError:
        return False
    return False
