"""A member restarted from an older copy of its data dir rejoins; nobody bans it.

Two ``lattica join`` daemons on loopback. The operator copies ``b``'s data dir while it runs (a
backup); ``b`` runs on for a few heartbeats — the swarm now holds entries of ``b`` newer than
the copy — and is stopped; the operator puts the copy back and starts it. The restored ``b`` must not sign those
sequence numbers again (``a`` would hold two histories of it and ban it for good): it learns
its newer entries from ``a`` before publishing anything and supersedes them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lattica_lab.daemons import DaemonProcess, wait_for
from lattica_lab.training_daemons import killed_at_end


def _heartbeat(daemon: DaemonProcess, peer: str) -> int:
    record = daemon.call("state")["members"].get(peer) or {}
    return int(record.get("heartbeat") or 0)


def _live(daemon: DaemonProcess, peer: str) -> bool:
    return peer in daemon.call("state")["live"]


def test_a_member_restored_from_a_backup_of_its_data_dir_is_not_banned(tmp_path: Path) -> None:
    with killed_at_end() as daemons:
        a = DaemonProcess(tmp_path / "a").start()
        daemons.append(a)
        a.wait_ready(timeout=30)
        b = DaemonProcess(tmp_path / "b", peers=(a.addr,)).start()
        daemons.append(b)
        b.wait_ready(timeout=30)
        b_id = b.peer_id
        assert wait_for(lambda: _live(a, b_id), 30)
        backup = tmp_path / "b-backup"  # a copy taken while it runs
        shutil.copytree(b.data_dir, backup, ignore=shutil.ignore_patterns("control.sock", "daemon.log"))
        at_copy = _heartbeat(a, b_id)
        assert wait_for(lambda: _heartbeat(a, b_id) >= at_copy + 4, 30), "a holds b's newer entries"
        b.stop()
        shutil.rmtree(b.data_dir)
        shutil.copytree(backup, b.data_dir)

        b.start().wait_ready(timeout=30)  # restored
        assert wait_for(lambda: _live(a, b_id), 20), (a.call("state")["banned"], b.log())
        beat = _heartbeat(a, b_id)
        assert wait_for(lambda: _heartbeat(a, b_id) >= beat + 2, 10), "a takes b's entries of this life"
        state = a.call("state")
        assert state["banned"] == []
        assert "equivocation" not in state["node"]["updates_rejected"]
        assert _live(a, b_id)
        own = b.call("state")
        assert own["banned"] == []
        assert own["node"]["superseded_own"] == 1
