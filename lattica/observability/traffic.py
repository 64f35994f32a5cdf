"""``MeteredStream``: count the payload bytes of one libp2p stream into ``NodeMetrics``.

Wrap a stream right after ``host.new_stream`` or at the top of a stream handler; everything
that reads and writes through the wrapper (``read_message``, ``write_message``, tensor
transfers) is counted under the stream's protocol id in ``lattica_bytes_sent_total`` and
``lattica_bytes_received_total``. Every other attribute is the wrapped stream's own.
"""

from __future__ import annotations

from libp2p.abc import INetStream

from lattica.observability.metrics import NodeMetrics


class MeteredStream:
    """A libp2p stream whose ``read``/``write`` payload sizes are counted per protocol."""

    def __init__(self, stream: INetStream, metrics: NodeMetrics, protocol: str | None = None) -> None:
        self._stream = stream
        label = protocol if protocol is not None else str(stream.get_protocol())
        self._sent = metrics.bytes_sent.labels(protocol=label)
        self._received = metrics.bytes_received.labels(protocol=label)

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.read(n)
        self._received.inc(len(data))
        return data

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)
        self._sent.inc(len(data))

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)
