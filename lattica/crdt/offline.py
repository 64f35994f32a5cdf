"""Reading a node's replicated state from its data dir without a running daemon.

``lattica state`` falls back to this when no daemon answers on the data dir's control socket:
the state log is read (never written: a torn tail is skipped, not cut) and replayed through the
same validation as at daemon start — signatures are checked again — into a snapshot. Nobody is
live for a stopped node, and the run config is shown only for the ``admins`` given (offline the
node's admin list is unknown, so by default it is left out rather than trusted).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair

from lattica.crdt.documents import Snapshot
from lattica.crdt.durable import state_log_path
from lattica.crdt.envelope import RejectedUpdate
from lattica.crdt.log import read_records
from lattica.crdt.replica import Replica
from lattica.errors import ConfigError

_LOG_PREFIX, _LOG_SUFFIX = "state-", ".log"


def read_snapshot(data_dir: Path, run_id: str, *, admins: Iterable[str] = ()) -> Snapshot:
    """The snapshot stored under ``data_dir`` for ``run_id`` (empty state if there is no log)."""
    replica = Replica(run_id=run_id, key_pair=create_new_key_pair(), admins=admins)
    path = state_log_path(data_dir, run_id)
    if path.exists():
        try:
            records = read_records(path)
        except OSError as exc:
            raise ConfigError(f"cannot read state log {path}: {exc.strerror}") from None
        for record in records:
            try:
                replica.receive_wire(record)
            except RejectedUpdate:
                continue
    return replica.snapshot()


def stored_runs(data_dir: Path) -> list[str]:
    """The run ids whose state logs ``data_dir`` holds (run ids need no escaping in file names)."""
    if not data_dir.is_dir():
        return []
    names = (p.name for p in data_dir.glob(f"{_LOG_PREFIX}*{_LOG_SUFFIX}") if p.is_file())
    return sorted(n[len(_LOG_PREFIX) : -len(_LOG_SUFFIX)] for n in names)


def offline_dump(data_dir: Path, run_id: str | None = None) -> dict[str, object] | None:
    """What ``lattica state`` shows for a stopped node: the stored snapshot, nobody live.
    None when the data dir holds no state (of ``run_id``, if given)."""
    runs = stored_runs(data_dir)
    if run_id is None:
        if len(runs) > 1:
            raise ConfigError(
                f"data dir {data_dir} holds the state of runs {', '.join(runs)}; choose one with --run-id",
            )
        run_id = runs[0] if runs else None
    if run_id is None or run_id not in runs:
        return None
    snapshot = read_snapshot(data_dir, run_id)
    return {
        **snapshot,
        "live": [],
        "node": {"run_id": run_id, "offline": True, "log": str(state_log_path(data_dir, run_id))},
    }
