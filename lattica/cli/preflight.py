"""Checks ``lattica join`` runs on the local machine before it starts anything.

The config dataclasses check what a value looks like; these check what it means here: that the
data dir can hold the key, the state log and the control socket, and that the metrics address
is one of this machine's. Each failure is a ``ConfigError`` — the one line the user sees —
instead of an ``OSError`` from deep inside the start-up.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from lattica.errors import ConfigError


def prepare_data_dir(path: Path) -> None:
    """Create ``path`` (0700) if needed and prove that files can be written in it."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data dir {path} exists and is not a directory")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create data dir {path}: {exc.strerror or exc}") from None
    try:
        # a real write, not os.access: root passes access checks on a read-only mount
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"data dir {path} is not writable: {exc.strerror or exc}") from None


def check_metrics_host(host: str) -> None:
    """The metrics exporter binds ``host``: it must resolve to an address of this machine.

    Only the host is checked (on an ephemeral port); whether the port is free is the
    exporter's business when it starts.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"metrics host {host!r} cannot be resolved: {reason}") from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError as exc:
            errors.append(exc)
        else:
            return
    reason = errors[0].strerror if errors else "no address"
    raise ConfigError(f"metrics host {host!r} is not an address of this machine ({reason})")

