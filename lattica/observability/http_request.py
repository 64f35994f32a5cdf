"""The tiny slice of HTTP/1.x the metrics exporter needs, as sans-IO functions.

One request per connection: the client sends a request head (request line and headers, ended by
an empty line); we answer with a complete response carrying ``Content-Length`` and
``Connection: close``, then close. Bodies sent by the client are ignored. Anything that is not
a well-formed ``GET``/``HEAD`` request head of at most ``MAX_HEAD_BYTES`` is answered with a 4xx
status — never an exception that escapes the connection handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

MAX_HEAD_BYTES = 8192
_HEAD_TERMINATORS = (b"\r\n\r\n", b"\n\n")
_ALLOWED_METHODS = frozenset({"GET", "HEAD"})


class BadRequest(Exception):
    """The client sent something we refuse; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class RequestHead:
    method: str
    path: str
    headers: dict[str, str]


def head_length(buffer: bytes) -> int | None:
    """Length of the complete request head at the start of ``buffer``, or None if incomplete.

    Raises ``BadRequest`` (431) once the buffer exceeds ``MAX_HEAD_BYTES`` without a full head.
    """
    ends = [i + len(t) for t in _HEAD_TERMINATORS if (i := buffer.find(t)) >= 0]
    if ends:
        end = min(ends)
        if end > MAX_HEAD_BYTES:
            raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
        return end
    if len(buffer) > MAX_HEAD_BYTES:
        raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
    return None


def parse_request_head(head: bytes) -> RequestHead:
    """Parse a request head (as delimited by ``head_length``); raises ``BadRequest``."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "non-ASCII request head") from None
    lines = text.replace("\r\n", "\n").rstrip("\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, _version = parts
    if method not in _ALLOWED_METHODS:
        raise BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, f"method {method!r} not allowed")
    if not target.startswith("/"):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "request target must be a path")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(HTTPStatus.BAD_REQUEST, "malformed header line")
        headers[name.lower()] = value.strip()
    return RequestHead(method=method, path=target.split("?", 1)[0], headers=headers)


def render_response(
    status: HTTPStatus, body: bytes, *, content_type: str, include_body: bool = True
) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "\r\n"
    ).encode("ascii")
    return head + body if include_body else head


def render_error(status: HTTPStatus, reason: str) -> bytes:
    """A plain-text error response."""
    body = f"{status.value} {status.phrase}: {reason}\n".encode()
    return render_response(status, body, content_type="text/plain; charset=utf-8")
