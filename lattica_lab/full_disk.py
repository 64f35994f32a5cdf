"""A real full disk for tests: a small tmpfs mounted on a folder, filled to the last byte.

``small_tmpfs`` mounts it (root only: ``disk_unavailable_reason`` says why not) and unmounts it
when the block ends, also when the test failed; ``fill`` writes a file until the filesystem
refuses (``ENOSPC``), and removing that file gives the space back.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def disk_unavailable_reason() -> str | None:
    """Why a tmpfs cannot be mounted here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs (a disk that fills up) needs root"
    return None


@contextmanager
def small_tmpfs(mount_point: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` on ``mount_point`` (created if missing) while the block runs."""
    mount_point.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(mount_point)],
        check=True, capture_output=True, timeout=20,
    )
    try:
        yield mount_point
    finally:
        unmounted = subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=20)
        if unmounted.returncode != 0:  # still busy (a process of the test holds a file): detach it
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=20)


def fill(path: Path) -> int:
    """Write ``path`` until its filesystem is full (down to the last byte a partial page
    takes); the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for size in (65536, 4096, 256, 1):
            chunk = b"\0" * size
            while True:
                try:
                    written += f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return written
