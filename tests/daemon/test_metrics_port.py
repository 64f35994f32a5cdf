"""Two daemons side by side on one machine with the default metrics address (the README's
"different data dirs" promise), and a metrics address the user chose that is taken."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

from lattica.config import DEFAULT_METRICS_ADDR
from lattica_lab.daemons import DaemonProcess, free_port, run_cli, wait_for


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LATTICA_")}


class DefaultDaemon(DaemonProcess):
    """``lattica join --data-dir D --listen L [--peer P]``: every other setting its default."""

    def join_args(self) -> list[str]:
        args = ["join", "--data-dir", str(self.data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{self.port}"]
        for peer in self.peers:
            args += ["--peer", peer]
        return args

    def environment(self) -> dict[str, str] | None:
        return _clean_env()


def _hold_default_metrics_port() -> socket.socket | None:
    """Take the default port, as a daemon started before the test would; None when someone
    on this machine already has it (then it is taken all the same)."""
    host, port = DEFAULT_METRICS_ADDR.rsplit(":", 1)
    s = socket.socket()
    try:
        s.bind((host, int(port)))
        s.listen(1)
    except OSError:
        s.close()
        return None
    return s


def _scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as response:
        return response.read().decode()


def test_two_daemons_with_default_settings_run_side_by_side(tmp_path: Path):
    holder = _hold_default_metrics_port()
    daemons: list[DaemonProcess] = []
    try:
        first = DefaultDaemon(tmp_path / "a").start()
        daemons.append(first)
        first.wait_ready(timeout=60)
        second = DefaultDaemon(tmp_path / "b", peers=(first.addr,)).start()
        daemons.append(second)
        second.wait_ready(timeout=60)

        addrs = [d.call("status")["metrics_addr"] for d in daemons]
        assert DEFAULT_METRICS_ADDR not in addrs  # taken before either started
        assert len(set(addrs)) == 2, addrs
        for daemon, addr in zip(daemons, addrs, strict=True):
            assert daemon.peer_id in _scrape(addr)
            assert f"serving metrics on http://{addr}/metrics" in daemon.log()
        assert wait_for(lambda: second.call("status")["connected_peers"] >= 1, timeout=20)
    finally:
        for d in daemons:
            d.kill()
        if holder is not None:
            holder.close()


def test_a_taken_metrics_address_the_user_named_is_one_error_line(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run_cli(
            "join", "--data-dir", str(tmp_path / "c"), "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
            "--metrics-addr", addr, env=_clean_env(),
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"lattica: error: cannot serve metrics on {addr}: in use (choose another --metrics-addr, or off)"
    ]
