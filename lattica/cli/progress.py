"""Live training progress for humans: a rich table on a terminal, plain log lines elsewhere.

``ProgressDisplay.update(node_label, round=..., loss=...)`` records the latest values for one
node (a demo may drive several nodes from one process). On a TTY the whole table is redrawn in
place, at most ``REFRESH_INTERVAL`` times per second and without a background thread (rich's
auto-refresh thread is disabled). Off a TTY (CI logs, ``docker logs``) each node prints one
``key=value`` line when something changed: at once for a new round or phase (loading,
training, done), at most every ``LOG_INTERVAL`` seconds for other fields (the inner step, the
loss); a throughput figure alone (``tokens_per_s``, which moves all the time) never makes a
line, and a line is never printed twice, so logs stay readable and greppable.
``render_summary(rows)`` formats the end-of-run table as text.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.table import Table

REFRESH_INTERVAL = 0.1
LOG_INTERVAL = 10.0
_NOT_A_CHANGE = frozenset({"tokens_per_s"})  # shown, but moves on every poll
_TEXT_COLUMNS = frozenset({"phase", "step"})  # may hold words: one line, cut short when narrow
_TEXT_WIDTH = 8


@dataclass(frozen=True, kw_only=True)
class NodeProgress:
    """The latest known values for one node; None means "not reported yet"."""

    round: int | None = None
    step: int | None = None
    phase: str | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    peers: int | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None


_COLUMNS = {
    "round": "round",
    "step": "step",
    "phase": "phase",
    "loss": "loss",
    "tokens_per_s": "tokens/s",
    "peers": "peers",
    "bytes_sent": "sent",
    "bytes_received": "received",
}


def format_bytes(count: float) -> str:
    """Human-readable binary size without spaces (log lines stay ``key=value``): ``'1.5KiB'``."""
    if abs(count) < 1024:
        return f"{count:.0f}B"
    value, unit = float(count), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        value, unit = value / 1024, larger
        if abs(value) < 1024:
            break
    return f"{value:.1f}{unit}"


def format_value(name: str, value: object) -> str:
    """How one field is shown in tables and log lines."""
    if value is None:
        return "-"
    if name.startswith("bytes_") and isinstance(value, int | float):
        return format_bytes(value)
    if name.endswith("loss") and isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def _table(rows: Mapping[str, Mapping[str, object]], *, title: str | None = None) -> Table:
    names: list[str] = []
    for row in rows.values():
        names += [name for name in row if name not in names]
    table = Table(title=title)
    table.add_column("node", style="bold")
    for name in names:
        if name in _TEXT_COLUMNS:
            table.add_column(_COLUMNS.get(name, name), no_wrap=True, overflow="ellipsis", max_width=_TEXT_WIDTH)
        else:
            table.add_column(_COLUMNS.get(name, name), justify="right")
    for label, row in rows.items():
        table.add_row(label, *(format_value(name, row.get(name)) for name in names))
    return table


def render_summary(rows: Mapping[str, Mapping[str, object]], *, title: str = "Summary") -> str:
    """A plain-text table (no colour codes) of ``{node_label: {field: value}}``."""
    console = Console(width=120, record=False, color_system=None, force_terminal=False)
    with console.capture() as capture:
        console.print(_table(rows, title=title))
    return capture.get()


class ProgressDisplay:
    """Shows the progress of one or more nodes; call ``close()`` (or use ``with``) at the end."""

    def __init__(
        self,
        *,
        is_tty: bool | None = None,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._is_tty = self._stream.isatty() if is_tty is None else is_tty
        self._clock = clock
        self._nodes: dict[str, NodeProgress] = {}
        self._last_log: dict[str, float] = {}
        self._last_logged: dict[str, NodeProgress] = {}
        self._last_refresh = -float("inf")
        self._live: Live | None = None
        if self._is_tty:
            console = Console(file=self._stream, force_terminal=True)
            self._live = Live(console=console, auto_refresh=False, transient=False)
            self._live.start()

    @property
    def is_tty(self) -> bool:
        return self._is_tty

    def snapshot(self) -> dict[str, NodeProgress]:
        """The latest values of every node, by label."""
        return dict(self._nodes)

    def update(
        self,
        node_label: str,
        *,
        round: int | None = None,
        step: int | None = None,
        phase: str | None = None,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        peers: int | None = None,
        bytes_sent: int | None = None,
        bytes_received: int | None = None,
    ) -> None:
        """Record new values for ``node_label``; fields left at None keep their last value."""
        previous = self._nodes.get(node_label, NodeProgress())
        current = NodeProgress(
            round=previous.round if round is None else round,
            step=previous.step if step is None else step,
            phase=previous.phase if phase is None else phase,
            loss=previous.loss if loss is None else loss,
            tokens_per_s=previous.tokens_per_s if tokens_per_s is None else tokens_per_s,
            peers=previous.peers if peers is None else peers,
            bytes_sent=previous.bytes_sent if bytes_sent is None else bytes_sent,
            bytes_received=previous.bytes_received if bytes_received is None else bytes_received,
        )
        self._nodes[node_label] = current
        if self._live is not None:
            self._refresh(self._live, force=False)
        else:
            milestone = (current.round, current.phase) != (previous.round, previous.phase)
            self._maybe_log(node_label, current, milestone=milestone)

    def close(self) -> None:
        """Draw the final state and release the terminal."""
        if self._live is not None:
            self._refresh(self._live, force=True)
            self._live.stop()
            self._live = None

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _refresh(self, live: Live, *, force: bool) -> None:
        now = self._clock()
        if not force and now - self._last_refresh < REFRESH_INTERVAL:
            return
        self._last_refresh = now
        rows = {label: _live_row(node) for label, node in self._nodes.items()}
        live.update(_table(rows, title="Lattica"), refresh=True)

    def _maybe_log(self, label: str, node: NodeProgress, *, milestone: bool) -> None:
        now = self._clock()
        last = self._last_logged.get(label)
        if last is not None and not _changed(last, node):
            return
        if not milestone and now - self._last_log.get(label, -float("inf")) < LOG_INTERVAL:
            return
        self._last_log[label] = now
        self._last_logged[label] = node
        parts = [f"{name}={_log_value(name, getattr(node, name))}" for name in _COLUMNS]
        self._stream.write(f"[{label}] " + " ".join(parts) + "\n")
        self._stream.flush()


def _live_row(node: NodeProgress) -> dict[str, object]:
    """A row of the live table: the inner step while training, else what the node is doing
    in its place, in a word (starting, waiting, loading, done). One column for both keeps
    the table within 80 columns; the log lines say the whole phase."""
    row = {f.name: getattr(node, f.name) for f in fields(node) if f.name != "phase"}
    if node.phase and (node.phase != "training" or node.step is None):
        row["step"] = node.phase.split()[0]
    return row


def _log_value(name: str, value: object) -> str:
    """A value in a ``key=value`` log line: no spaces (a phase reads ``waiting_for_peers``)."""
    return format_value(name, value).replace(" ", "_")


def _changed(before: NodeProgress, after: NodeProgress) -> bool:
    return any(
        getattr(before, f.name) != getattr(after, f.name) for f in fields(after) if f.name not in _NOT_A_CHANGE
    )


def summary_rows(displays: Iterable[tuple[str, NodeProgress]]) -> dict[str, dict[str, object]]:
    """Turn ``(label, NodeProgress)`` pairs into rows for ``render_summary``."""
    return {label: {f.name: getattr(p, f.name) for f in fields(p)} for label, p in displays}
