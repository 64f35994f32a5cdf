"""The control protocol between the CLI and its local daemon.

Theory of operation: the daemon listens on a Unix socket inside its data dir (mode 0600, so
only the node's owner can talk to it, and nothing outside the machine can). A client sends one
JSON object on one line — ``{"method": "status", "params": {}}`` — and reads one JSON line
back: ``{"ok": true, "result": …}`` or ``{"ok": false, "error": "…"}``. Then the connection
closes. Requests are capped at ``MAX_REQUEST_BYTES``; anything malformed gets an error reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from lattica.decoding import str_map
from lattica.errors import LocalProtocolError

MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
METHOD_NAMES = frozenset({"status", "peers", "state", "train", "id", "shutdown", "doctor", "tune"})


@dataclass(frozen=True)
class ControlRequest:
    method: str
    params: dict[str, object]


class BadRequest(ValueError):
    """The request line is not a valid control request."""


def encode_request(method: str, params: Mapping[str, object] | None = None) -> bytes:
    return json.dumps({"method": method, "params": params or {}}).encode() + b"\n"


def decode_request(line: bytes) -> ControlRequest:
    if len(line) > MAX_REQUEST_BYTES:
        raise BadRequest("request too large")
    try:
        obj: object = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BadRequest("request is not JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("request must be a JSON object")
    method = obj.get("method")
    raw_params = obj.get("params", {})
    if not isinstance(method, str) or method not in METHOD_NAMES:
        raise BadRequest(f"unknown method {method!r}")
    params = str_map(raw_params)  # JSON object keys are strings
    if params is None:
        raise BadRequest("params must be an object")
    return ControlRequest(method, params)


def encode_response(*, result: object = None, error: str | None = None) -> bytes:
    if error is not None:
        return json.dumps({"ok": False, "error": error}).encode() + b"\n"
    return json.dumps({"ok": True, "result": result}, default=str).encode() + b"\n"


def decode_response(line: bytes) -> object:
    """Return the result, or raise ``LocalProtocolError`` with the daemon's error message."""
    try:
        obj: object = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LocalProtocolError("daemon sent a malformed reply") from None
    if not isinstance(obj, dict) or "ok" not in obj:
        raise LocalProtocolError("daemon sent a malformed reply")
    if not obj["ok"]:
        raise LocalProtocolError(str(obj.get("error", "unknown error")))
    return obj.get("result")
