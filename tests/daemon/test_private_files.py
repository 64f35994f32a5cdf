"""What a daemon writes in its data dir is for its owner only: the folder 0700, files 0600,
whatever the umask."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from lattica.control import client
from lattica.errors import LatticaError
from lattica.files import append_private
from lattica_lab.daemons import free_port, lattica_command, wait_for


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _answers(path: Path) -> bool:
    try:
        return bool(client.call(path, "id", timeout=5))
    except LatticaError:
        return False


@pytest.mark.usefixtures("wide_umask")
def test_a_new_data_dir_and_its_files_are_private(tmp_path):
    data_dir = tmp_path / "fresh" / "node"  # created by the daemon itself
    proc = subprocess.Popen(
        lattica_command(
            "join", "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
            "--metrics-addr", "off",
        ),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for(lambda: _answers(data_dir / "control.sock"), timeout=30)
        assert _mode(data_dir) == 0o700
        for path in data_dir.iterdir():
            assert _mode(path) & 0o077 == 0, f"{path.name} is {_mode(path):04o}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("wide_umask")
def test_the_crash_log_is_private_and_narrowed_if_it_was_not(tmp_path):
    fresh = tmp_path / "crash.log"
    append_private(fresh, "Traceback ...\n")
    assert _mode(fresh) == 0o600
    older = tmp_path / "old-crash.log"
    older.write_text("from an older version\n")
    assert _mode(older) == 0o644
    append_private(older, "Traceback ...\n")
    assert _mode(older) == 0o600
    assert older.read_text() == "from an older version\nTraceback ...\n"

