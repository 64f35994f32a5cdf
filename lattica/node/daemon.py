"""Running ``lattica join``'s node as a process, until ``lattica stop``, SIGTERM or SIGINT.

The three promise that the process is gone within
SHUTDOWN_DEADLINE_S of the request. Node.run spends at most 3.5 s on goodbyes (services, then
peers), then cancels its services; a service inside ``trio.to_thread.run_sync`` (an inner step
of a large model, a checkpoint fsync) or in CPU work on the trio thread (the outer step of a
large model) delays that cancellation, so a watchdog ends the process at the deadline
whatever is still running. Checkpoints and the state log are written atomically, so an exit
at any point leaves them intact. Finally, Python's own teardown collects every object left
(the libp2p and torch object graphs: 3-5 s measured): ``run_until_stopped`` freezes them
first, as the process ends right after.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable

import trio
from libp2p.crypto.keys import KeyPair
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.node.composition import build_node
from lattica.node.node import Node

log = logging.getLogger(__name__)

SHUTDOWN_DEADLINE_S = 4.0


def run_until_stopped(
    config: NodeConfig, key_pair: KeyPair, *, secret: bytes | None = None,
    on_started: Callable[[Node], None] = lambda node: None,
) -> int:
    """``lattica join`` in this process: run the daemon until it is stopped; the exit code."""

    async def main() -> None:
        await serve(build_node(config, key_pair, secret=secret), on_started=on_started)

    trio.run(main)
    gc.freeze()  # nothing is collected any more: the interpreter exits next
    return 0


async def serve(node: Node, *, on_started: Callable[[Node], None] = lambda node: None) -> None:
    """Run ``node`` until ``lattica stop``, SIGTERM or SIGINT; return once it is down.

    The first signal (or the control request) starts the graceful shutdown of ``Node.run``; a
    second signal cancels at once. Either way this returns when ``Node.run`` has returned, or
    the process ends at ``SHUTDOWN_DEADLINE_S`` after the request.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, signals, node, nursery.cancel_scope)
            nursery.start_soon(_exit_when_overdue, node)
            await nursery.start(_run_node, node, nursery.cancel_scope)
            on_started(node)


async def _run_node(node: Node, scope: trio.CancelScope, *, task_status: TaskStatus[Node]) -> None:
    try:
        await node.run(task_status=task_status)
    finally:
        scope.cancel()  # the signal watcher and the watchdog must not outlive the node


async def _stop_on_signals(signals: AsyncIterator[int], node: Node, scope: trio.CancelScope) -> None:
    async for _ in signals:
        if node.host is None or node.shutdown_requested:  # still starting, or asked twice
            scope.cancel()
            return
        node.request_shutdown()


async def _exit_when_overdue(node: Node) -> None:
    await node.wait_for_shutdown_request()
    await trio.sleep(SHUTDOWN_DEADLINE_S)
    log.warning("the daemon's services did not stop within %g s; exiting now", SHUTDOWN_DEADLINE_S)
    with contextlib.suppress(OSError):
        os.unlink(node.config.control_socket)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
