"""Plain-text tables for the CLI's human output (``--json`` prints the raw objects)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def key_values(pairs: Sequence[tuple[str, object]]) -> str:
    width = max((len(k) for k, _ in pairs), default=0)
    out = []
    for key, value in pairs:
        shown = value
        if isinstance(value, list | tuple):
            shown = ("\n" + " " * (width + 2)).join(str(v) for v in value) or "-"
        out.append(f"{key.ljust(width)}  {shown}")
    return "\n".join(out)


def short_id(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"
