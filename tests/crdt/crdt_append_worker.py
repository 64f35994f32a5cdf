"""Subprocess for the crash test: writes checkpoints through ReplicatedState forever and
prints ``acked <round>`` after each write returns (i.e. after it was fsync'd)."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from lattica.crdt import ReplicaLimits, ReplicatedState, StateConfig
from lattica.net.host import build_host
from lattica.net.identity import load_or_create_identity

CONFIG = StateConfig(limits=ReplicaLimits(snapshot_every=8), compact_min_records=20)


async def main(data_dir: Path) -> None:
    key_pair = load_or_create_identity(data_dir)
    host = build_host(key_pair)
    state = ReplicatedState(host, key_pair, data_dir=data_dir, run_id="crash", config=CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(state.run)
        print("ready", flush=True)
        for round_ in range(1_000_000):
            await state.add_checkpoint(round_, [f"h{round_}"])
            print(f"acked {round_}", flush=True)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
