"""The node that started the swarm stops and is started again with the same command.

Two ``lattica join`` processes with default settings on loopback, exactly as a user runs them:
the founder (no ``--peer``) and a joiner. ``lattica stop`` on the founder says goodbye (the
joiner marks it as left); the same ``lattica join`` again must find the joiner — the founder
redials the members saved in its data dir, and the joiner keeps redialing a peer that left
(which alone brings the two together when the founder's saved book is gone).
"""

from __future__ import annotations

import json
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from lattica_lab.daemons import DaemonProcess, cli_json, run_cli, wait_for


@dataclass
class PlainJoin(DaemonProcess):
    """``lattica join --data-dir D --listen /ip4/127.0.0.1/tcp/P [--peer …]``: nothing else."""

    def join_args(self) -> list[str]:
        args = ["join", "--data-dir", str(self.data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{self.port}"]
        for peer in self.peers:
            args += ["--peer", peer]
        return args


def _peers(daemon: DaemonProcess) -> dict[str, dict]:
    return {p["peer_id"]: p for p in cli_json("peers", "--data-dir", str(daemon.data_dir))}


def test_a_stopped_founder_started_again_is_connected_to_the_joiner_within_seconds(tmp_path: Path) -> None:
    founder = PlainJoin(tmp_path / "A").start()
    started = [founder]
    try:
        founder.wait_ready(60)
        founder_id, founder_addr = founder.peer_id, founder.addr
        joiner = PlainJoin(tmp_path / "B", port=founder.port + 1, peers=(founder_addr,)).start()
        started.append(joiner)
        joiner.wait_ready(60)
        assert wait_for(lambda: _peers(joiner).get(founder_id, {}).get("connected"), 20), joiner.log()

        assert run_cli("stop", "--data-dir", str(founder.data_dir)).returncode == 0
        assert founder.proc is not None
        assert founder.proc.wait(timeout=10) == 0
        assert wait_for(lambda: _peers(joiner)[founder_id]["left"], 10), _peers(joiner)
        again = PlainJoin(tmp_path / "A", port=founder.port).start()  # the same command
        started.append(again)
        again.wait_ready(60)
        up = time.monotonic()
        assert wait_for(lambda: _peers(joiner)[founder_id]["connected"], 20), (_peers(joiner), again.log())
        assert time.monotonic() - up < 20
        assert _peers(joiner)[founder_id]["left"] is False
        assert wait_for(lambda: _peers(again).get(joiner.peer_id, {}).get("connected"), 10), again.log()
        assert "rejoined run 'default' through 1 member(s) known from before" in again.log()
        # what the founder remembered: the joiner, in a file only its owner reads
        saved = founder.data_dir / "known-peers.json"
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert [p["id"] for p in json.loads(saved.read_text())["peers"]] == [joiner.peer_id]

        # without its saved book the founder knows nobody: the joiner redials the peer that
        # left (at the slower pace of a goodbye) and finds it
        assert run_cli("stop", "--data-dir", str(founder.data_dir)).returncode == 0
        assert again.proc is not None
        assert again.proc.wait(timeout=10) == 0
        saved.unlink()
        assert wait_for(lambda: _peers(joiner)[founder_id]["left"], 10), _peers(joiner)
        third = PlainJoin(tmp_path / "A", port=founder.port).start()
        started.append(third)
        third.wait_ready(60)
        assert wait_for(lambda: _peers(joiner)[founder_id]["connected"], 30), (_peers(joiner), joiner.log())
    finally:
        for daemon in started:
            daemon.kill()
