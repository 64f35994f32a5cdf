"""``MetricsServer``: serves a node's registry at ``GET /metrics`` on trio sockets.

prometheus_client ships its own HTTP server, but it runs in a background thread; a Lattica node
keeps every task in its trio nursery, so this exporter is a small trio TCP server instead.

Robustness: each connection gets ``HEAD_TIMEOUT`` seconds in all to send its request head (at
most ``MAX_HEAD_BYTES``; trickling bytes does not extend it) and ``WRITE_TIMEOUT`` seconds to
read the answer; after that it is simply closed. At most ``max_connections`` are served at once.
When all are taken, a new connection displaces the one that has waited longest for its own
request head — a scraper sends its head in one packet, so slow or silent connections (a
slowloris) cannot keep scrapes out — and only when every connection is past its head does the
newcomer get a 503. A broken or hostile client only ever costs its own connection.

Binding: with ``port_search=n`` a taken port moves the exporter to the next free one of the
following ``n`` (several daemons on one machine share the default address); the bound address
is ``address``. A port that cannot be had is a ``ConfigError`` naming the address.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
from http import HTTPStatus

import trio
from prometheus_client.exposition import choose_encoder
from trio_typing import TaskStatus

from lattica.client_slots import ClientSlots
from lattica.errors import ConfigError
from lattica.observability.http_request import (
    BadRequest,
    head_length,
    parse_request_head,
    render_error,
    render_response,
)
from lattica.observability.metrics import NodeMetrics

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
METRICS_PATH = "/metrics"


class MetricsServer:
    """HTTP exporter for one ``NodeMetrics``; ``port=0`` picks a free port."""

    def __init__(
        self, metrics: NodeMetrics, host: str, port: int, *, max_connections: int = 16,
        port_search: int = 0,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        if port_search < 0:
            raise ValueError(f"port_search must be >= 0, got {port_search}")
        self._port_search = port_search if port else 0
        self._metrics = metrics
        self._host = host
        self._port = port
        self._slots = ClientSlots(max_connections)
        self.address: tuple[str, int] | None = None
        """The bound (host, port), set once ``run`` has started."""

    async def run(
        self, *, task_status: TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``task_status.started((host, port))`` once bound."""
        listeners = await self._bind()
        sock = listeners[0].socket
        host, port = sock.getsockname()[:2]
        self.address = (host, port)
        log.info("metrics exporter listening on http://%s:%d%s", host, port, METRICS_PATH)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.address)

    async def _bind(self) -> Sequence[trio.SocketListener]:
        port, last = self._port, min(self._port + self._port_search, 65535)
        while True:
            try:
                return await trio.open_tcp_listeners(port, host=self._host)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and port < last:
                    port += 1
                    continue
                where = f"{self._host}:{self._port}" + (f"-{last}" if last > self._port else "")
                reason = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
                raise ConfigError(
                    f"cannot serve metrics on {where}: {reason} (choose another --metrics-addr, or off)"
                ) from None

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if not self._slots.take():
                await self._send(stream, render_error(HTTPStatus.SERVICE_UNAVAILABLE, "busy"))
                return
            try:
                await self._serve_one(stream)
            finally:
                self._slots.give_back()

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        head = b""
        try:
            with trio.move_on_after(HEAD_TIMEOUT) as scope, self._slots.reading(scope):
                head = await self._read_head(stream)
            if not head:
                return  # timed out or the client hung up before a full request
            response = self._respond(head)
        except BadRequest as exc:
            response = render_error(exc.status, str(exc))
        except (trio.BrokenResourceError, OSError):
            return
        await self._send(stream, response)

    async def _read_head(self, stream: trio.SocketStream) -> bytes:
        buffer = bytearray()
        while (length := head_length(bytes(buffer))) is None:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return b""
            buffer += chunk
        return bytes(buffer[:length])

    def _respond(self, head: bytes) -> bytes:
        request = parse_request_head(head)
        if request.path != METRICS_PATH:
            return render_error(HTTPStatus.NOT_FOUND, f"try {METRICS_PATH}")
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = encoder(self._metrics.registry)
        return render_response(
            HTTPStatus.OK, body, content_type=content_type, include_body=request.method == "GET"
        )

    async def _send(self, stream: trio.SocketStream, response: bytes) -> None:
        with trio.move_on_after(WRITE_TIMEOUT):
            try:
                await stream.send_all(response)
                # Half-close so the client sees EOF after the body even if it ignores the headers.
                stream.socket.shutdown(socket.SHUT_WR)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
