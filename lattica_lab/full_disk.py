"""A real full disk for tests: a small tmpfs mounted on a folder, filled to the last byte.

``small_tmpfs`` mounts it (root only: ``disk_unavailable_reason`` says why not) and unmounts it
when the block ends, also when the test failed; ``fill`` writes a file until the filesystem
refuses (``ENOSPC``), and removing that file gives the space back. ``kept_full`` keeps it full
while a block runs: a write that fails removes its temporary file (a checkpoint: megabytes),
and that space is taken again at once, as a disk that another program fills would be.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def disk_unavailable_reason() -> str | None:
    """Why a tmpfs cannot be mounted here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs (a disk that fills up) needs root"
    return None


@contextmanager
def small_tmpfs(mount_point: Path, size_bytes: int, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` (and at most ``inodes`` files and folders) on ``mount_point``
    (created if missing) while the block runs."""
    mount_point.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
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
    with path.open("ab", buffering=0) as f:
        return _write_until_full(f)


@contextmanager
def kept_full(folder: Path, interval_s: float = 0.01) -> Iterator[None]:
    """The filesystem of ``folder`` full while the block runs (space freed meanwhile is taken
    again within ``interval_s``), and its space back when the block ends."""
    path = folder / ".filler"
    stop = threading.Event()
    with path.open("ab", buffering=0) as f:
        _write_until_full(f)

        def top_up() -> None:
            while not stop.wait(interval_s):
                _write_until_full(f)

        keeper = threading.Thread(target=top_up, name="disk-filler", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            stop.set()
            keeper.join()
    path.unlink()


def use_all_inodes(folder: Path) -> list[Path]:
    """Create empty files in ``folder`` until no inode is left; the files."""
    made: list[Path] = []
    while True:
        path = folder / f".inode-{len(made)}"
        try:
            path.touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)


def _write_until_full(f: BinaryIO) -> int:
    written = 0
    for size in (65536, 4096, 256, 1):
        chunk = b"\0" * size
        while True:
            try:
                written += f.write(chunk) or 0
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return written
