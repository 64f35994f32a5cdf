"""The CLI side of the control socket."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from lattica.control.protocol import MAX_RESPONSE_BYTES, decode_response, encode_request
from lattica.errors import DaemonNotRunningError, LocalProtocolError


def call(
    socket_path: Path, method: str, params: Mapping[str, object] | None = None, *, timeout: float = 15.0
) -> object:
    """One blocking request/response with the daemon behind ``socket_path``."""
    if not socket_path.exists():
        raise DaemonNotRunningError(f"no daemon running for data dir {socket_path.parent}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(socket_path))
        except OSError:
            raise DaemonNotRunningError(f"no daemon answers on {socket_path}") from None
        buf = bytearray()
        try:
            sock.sendall(encode_request(method, params))
        except OSError:
            raise DaemonNotRunningError(f"the daemon at {socket_path} closed the connection") from None
        while not buf.endswith(b"\n"):
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                raise LocalProtocolError(f"daemon did not answer {method!r} within {timeout:.0f} s") from None
            except OSError:
                raise DaemonNotRunningError(f"the daemon at {socket_path} closed the connection") from None
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_RESPONSE_BYTES:
                raise LocalProtocolError("daemon reply too large")
    finally:
        sock.close()
    return decode_response(bytes(buf))
