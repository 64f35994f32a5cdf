"""A daemon whose one extra service is stuck in a worker thread, for the shutdown-deadline test.

Usage: python stuck_service_daemon.py DATA_DIR. Prints "ready" once the node runs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.net.identity import load_or_create_identity
from lattica.node.composition import build_node
from lattica.node.daemon import serve
from lattica.node.services import NodeContext


class StuckInAThread:
    """Blocks a worker thread for two minutes: cancelling it waits for the thread."""

    name = "stuck"

    def __init__(self, context: NodeContext) -> None:
        self.context = context

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.to_thread.run_sync(time.sleep, 120.0)


def main() -> None:
    data_dir = Path(sys.argv[1])
    config = NodeConfig(
        data_dir=data_dir, listen=("/ip4/127.0.0.1/tcp/0",), metrics_addr=None, nat=False, dht=False,
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    node = build_node(config, load_or_create_identity(data_dir), extra=lambda context: [StuckInAThread(context)])
    trio.run(lambda: serve(node, on_started=lambda _: print("ready", flush=True)))


if __name__ == "__main__":
    main()
