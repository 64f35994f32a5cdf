"""The daemon side of the control socket (see ``protocol`` for the wire format)."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from trio_typing import TaskStatus

from lattica.control.protocol import (
    MAX_REQUEST_BYTES,
    BadRequest,
    ControlRequest,
    decode_request,
    encode_response,
)
from lattica.errors import ConfigError, LatticaError

log = logging.getLogger(__name__)

Handler = Callable[[ControlRequest], Awaitable[Any]]
_REQUEST_TIMEOUT_S = 10.0


class ControlServer:
    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self._handler = handler

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = await self._listen()
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve_one, stream)
        finally:
            self.path.unlink(missing_ok=True)
            listener.socket.close()

    async def _listen(self) -> trio.SocketListener:
        if self.path.exists():
            if await _socket_answers(self.path):
                raise ConfigError(f"another daemon is already running with data dir {self.path.parent}")
            self.path.unlink()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot create control socket {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        sock.listen(16)
        return trio.SocketListener(sock)

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(_REQUEST_TIMEOUT_S):
                try:
                    line = await _read_line(stream)
                    request = decode_request(line)
                except BadRequest as exc:
                    await stream.send_all(encode_response(error=str(exc)))
                    return
                except trio.BrokenResourceError:
                    return
                try:
                    result = await self._handler(request)
                    reply = encode_response(result=result)
                except LatticaError as exc:
                    reply = encode_response(error=str(exc))
                except Exception as exc:  # a bug in a handler must not kill the daemon
                    log.exception("control request %s failed", request.method)
                    reply = encode_response(error=f"internal error: {exc!r}")
                try:
                    await stream.send_all(reply)
                except trio.BrokenResourceError:
                    pass


async def _read_line(stream: trio.SocketStream) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        if len(buf) > MAX_REQUEST_BYTES:
            raise BadRequest("request too large")
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
    return bytes(buf.split(b"\n", 1)[0])


async def _socket_answers(path: Path) -> bool:
    try:
        with trio.move_on_after(1.0):
            stream = await trio.open_unix_socket(str(path))
            await stream.aclose()
            return True
    except OSError:
        return False
    return False
