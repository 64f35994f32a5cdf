"""Reading the small files a user hands us (config, peers list, key, secret) as untrusted input,
and writing the daemon's own private files (``append_private``).

Every failure is a ``ConfigError`` whose message names the file and what is wrong, fit to be
the one line the CLI prints. The size cap is checked before the content is used, so a huge or
endless file (``/dev/zero``) costs at most ``max_bytes + 1`` bytes of memory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lattica.errors import ConfigError


def read_capped(path: Path, *, what: str, max_bytes: int, private: bool = False) -> bytes:
    """The bytes of ``path``; ``private`` files must not be accessible to group or others."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what} {path} is a directory, not a file")
        if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{what} {path} has mode {stat.S_IMODE(mode):04o}; it must be 0600 (run: chmod 600 {path})"
            )
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise ConfigError(f"{what} {path} is larger than {max_bytes} bytes")
    return raw


def read_text(path: Path, *, what: str, max_bytes: int) -> str:
    try:
        return read_capped(path, what=what, max_bytes=max_bytes).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None


def append_private(path: Path, text: str) -> None:
    """Append ``text`` to ``path``, a file only its owner can read (0600; narrowed if wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        os.fchmod(fd, 0o600)
        f.write(text)
