"""A daemon that does not train never loads torch: real ``lattica join`` processes, looked at
from outside through ``/proc/<pid>/maps`` (importing torch maps its shared libraries into the
process; nothing a daemon reports about itself is trusted for this)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lattica_lab.daemons import DaemonProcess, run_cli, wait_for

pytestmark = pytest.mark.timeout(90)


def torch_libraries(pid: int) -> list[str]:
    """The torch shared objects mapped into process ``pid`` (``libtorch*.so``, ``libc10.so``)."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(("libtorch", "libc10")))


def test_the_marker_is_what_importing_torch_maps() -> None:
    """The check below looks for what an import of torch really leaves in a process."""
    import torch  # noqa: F401 - imported for its libraries

    assert torch_libraries(int(Path("/proc/self/stat").read_text().split()[0])), "torch maps no libtorch here"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/maps")
def test_a_daemon_that_does_not_train_never_loads_torch(tmp_path: Path) -> None:
    first = DaemonProcess(tmp_path / "a").start()
    second = None
    try:
        first.wait_ready(30)
        second = DaemonProcess(tmp_path / "b", peers=(first.addr,)).start()
        second.wait_ready(30)
        assert wait_for(lambda: any(p["connected"] for p in second.call("peers")), timeout=30), second.log()
        # the commands a user runs against an idle daemon are answered without the training stack
        for command in ("status", "peers", "state", "doctor"):
            result = run_cli(command, "--data-dir", str(second.data_dir), "--json", timeout=60)
            assert "Traceback" not in result.stderr, result.stderr
        for daemon in (first, second):
            assert daemon.proc is not None
            assert torch_libraries(daemon.proc.pid) == [], daemon.log()
    finally:
        for daemon in (first, second):
            if daemon is not None:
                daemon.stop()
