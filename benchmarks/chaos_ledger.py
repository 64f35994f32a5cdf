"""Chaos ledger: where a chaos run's member-rounds went, from its kept logs.

Reads a ``benchmarks/chaos.py --keep-dir DIR`` run: the benchmark's own output (its
``kill``/``cut``/``heal`` lines, saved to a file) and every daemon's ``daemon.log`` under
``DIR/chaos``. Each round of the run has six (``--nodes``) member slots; a slot is *counted*
when the member is in the round's largest group (``sync round/N done with K member(s)``, the
figure ``contributions`` of the benchmark sums). Every slot not counted is put in one bucket,
by what the member was doing when the round closed (the largest group's first ``done`` line):

- ``restart``: between its SIGKILL and its ``resumed at step`` line (the process starting,
  the host up, the checkpoint loaded);
- ``resumed``: after it resumed, before the first round it is counted in (adopting the swarm's
  state, waiting for a round);
- ``cut``: its link is cut; ``healed``: after the heal, before the first round it is counted in;
- ``split``: up, in a smaller group of its own that round (split or lone groups);
- ``absent``: up, in no group of that round at all (a skipped round: adopted past it).

Per kill it prints the rounds between the SIGKILL and the victim's first counted round, split
into restart and resumed, with the seconds of each. Last line: one JSON object of the totals.

    python benchmarks/chaos_ledger.py --output chaos-output.txt --keep-dir DIR
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

_DONE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) .*sync round/(\d+) done with (\d+) member")
_RESUMED = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) .*resumed at step (\d+)")
_EVENT = re.compile(r"^(\d\d):(\d\d):(\d\d) \+\s*([\d.]+)s (kill|cut|heal) n(\d+)")


def _clock(h: str, m: str, s: str) -> float:
    return int(h) * 3600 + int(m) * 60 + float(s)


@dataclass
class Node:
    done: dict[int, tuple[float, int]] = field(default_factory=dict)  # round -> (time, members)
    resumed: list[float] = field(default_factory=list)


def read_node(log: Path) -> Node:
    node = Node()
    for line in log.read_text(errors="replace").splitlines():
        if match := _DONE.match(line):
            node.done.setdefault(int(match[4]), (_clock(match[1], match[2], match[3]), int(match[5])))
        elif match := _RESUMED.match(line):
            node.resumed.append(_clock(match[1], match[2], match[3]))
    return node


def read_events(output: Path) -> list[tuple[float, str, int]]:
    """The benchmark's disturbances as (wall clock, kind, node): its lines carry the wall clock
    to the second and the run's clock to 0.1 s; the offset between them is pinned down by all
    lines together (each bounds it to one second)."""
    rows = [m for line in output.read_text().splitlines() if (m := _EVENT.match(line))]
    low, high = -1e18, 1e18
    for m in rows:
        wall, mono = _clock(m[1], m[2], m[3]), float(m[4])
        low, high = max(low, wall - mono - 0.05), min(high, wall + 1 - mono + 0.05)
    offset = (low + high) / 2
    return [(float(m[4]) + offset, m[5], int(m[6])) for m in rows]


def _slot(t: float, windows: list[tuple[float, float, str, str]]) -> str | None:
    for start, end, before, after in windows:
        if start <= t < end:
            return before if after == "" or t < float(after) else "resumed" if before == "restart" else "healed"
    return None


def ledger(output: Path, keep_dir: Path) -> dict[str, object]:
    logs = sorted((keep_dir / "chaos").glob("n*/daemon.log"), key=lambda p: int(p.parent.name[1:]))
    nodes = [read_node(log) for log in logs]
    events = read_events(output)
    rounds = sorted({r for node in nodes for r in node.done})
    best = {r: max(node.done[r][1] for node in nodes if r in node.done) for r in rounds}
    closed = {
        r: min(node.done[r][0] for node in nodes if r in node.done and node.done[r][1] == best[r]) for r in rounds
    }
    # per node: windows (start, end, kind, switch time) in which an uncounted slot is explained
    windows: list[list[tuple[float, float, str, str]]] = [[] for _ in nodes]
    kills = []
    for t, kind, i in events:
        if kind == "heal":
            continue
        node = nodes[i]
        if kind == "kill":
            switch = min((x for x in node.resumed if x > t), default=float("inf"))
        else:
            switch = min((x for x, k, j in events if k == "heal" and j == i and x > t), default=float("inf"))
        counted = [r for r in rounds if r in node.done and node.done[r][1] == best[r] and closed[r] >= switch]
        # back once counted again, or at its next disturbance (which then explains the rest)
        later = min((x for x, k, j in events if j == i and k != "heal" and x > t), default=float("inf"))
        back = min(node.done[counted[0]][0] if counted else float("inf"), later)
        windows[i].append((t, back, "restart" if kind == "kill" else "cut", repr(switch)))
        if kind == "kill":
            kills.append({
                "node": i,
                "restart_s": round(switch - t, 2),
                "resumed_s": round(back - switch, 2),
                "restart_rounds": sum(1 for r in rounds if t <= closed[r] < switch),
                "resumed_rounds": sum(1 for r in rounds if switch <= closed[r] < back),
            })
    buckets = {k: 0 for k in ("restart", "resumed", "cut", "healed", "split", "absent")}
    for r in rounds:
        for i, node in enumerate(nodes):
            if r in node.done and node.done[r][1] == best[r]:
                continue
            explained = _slot(closed[r], windows[i])
            if explained is not None:
                buckets[explained] += 1
            else:
                buckets["split" if r in node.done else "absent"] += 1
    for k in kills:
        print(json.dumps(k))
    counted_slots = sum(best.values())
    return {
        "rounds": len(rounds),
        "slots": len(rounds) * len(nodes),
        "counted": counted_slots,
        "uncounted": len(rounds) * len(nodes) - counted_slots,
        **buckets,
        "kills": len(kills),
        "restart_s_median": round(statistics.median(k["restart_s"] for k in kills), 2),
        "resumed_s_median": round(statistics.median(k["resumed_s"] for k in kills), 2),
        "restart_rounds_mean": round(statistics.mean(k["restart_rounds"] for k in kills), 1),
        "resumed_rounds_mean": round(statistics.mean(k["resumed_rounds"] for k in kills), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="the benchmark's output, saved")
    parser.add_argument("--keep-dir", type=Path, required=True)
    args = parser.parse_args()
    print(json.dumps(ledger(args.output, args.keep_dir)))


if __name__ == "__main__":
    main()
