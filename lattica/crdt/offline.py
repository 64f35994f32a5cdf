"""Reading a node's replicated state from its data dir without a running daemon.

For ``lattica state --json`` when the daemon is down: replays the state log through the same
validation as at daemon start (signatures are checked again) and returns the snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.crdt.envelope import RejectedUpdate
from lattica.crdt.log import AppendLog
from lattica.crdt.replica import Replica
from lattica.crdt.state import state_log_path


def read_snapshot(data_dir: Path, run_id: str, *, admins: Iterable[str]) -> dict[str, Any]:
    """The snapshot stored under ``data_dir`` for ``run_id`` (empty state if there is no log).

    Run config written by keys outside ``admins`` is ignored, as the daemon would.
    """
    replica = Replica(run_id=run_id, key_pair=create_new_key_pair(), admins=admins)
    path = state_log_path(data_dir, run_id)
    if path.exists():
        log, records = AppendLog.open(path)
        log.close()
        for record in records:
            try:
                replica.receive_wire(record)
            except RejectedUpdate:
                continue
    return replica.snapshot()
