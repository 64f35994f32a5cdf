"""Four real processes, each a libp2p host with ReplicatedState on loopback: they agree on
membership within seconds of a join, notice a clean leave at once and a crash after the lease."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import trio

from lattica_lab import lab_env

LEASE = 4.0


class Node:
    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.ready = trio.Event()
        self.peer_id = ""
        self.addr = ""
        self.live: list[str] = []
        self.left: list[str] = []
        self.changed = trio.Event()

    async def read_events(self) -> None:
        buffer = b""
        while chunk := await self.proc.stdout.receive_some(4096):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self._on_event(json.loads(line))

    def _on_event(self, event: dict) -> None:
        if event["event"] == "ready":
            self.peer_id, self.addr = event["peer_id"], event["addr"]
            self.ready.set()
        elif event["event"] == "live":
            self.live, self.left = event["live"], event["left"]
        self.changed.set()
        self.changed = trio.Event()


async def start_node(nursery, tmp_path, index: int, *extra: str) -> Node:
    data_dir = tmp_path / f"node{index}"
    data_dir.mkdir()
    command = [sys.executable, "-m", "lattica_lab.demo_node", "--data-dir", str(data_dir),
               "--run-id", "e2e", "--heartbeat", "0.5", "--lease", str(LEASE), *extra]
    stderr = (tmp_path / f"node{index}.stderr").open("wb")
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=stderr, env=lab_env())
    node = Node(proc)
    nursery.start_soon(node.read_events)
    return node


async def wait_until(predicate, nodes: list[Node], timeout: float) -> float:
    start = trio.current_time()
    with trio.fail_after(timeout):
        while not predicate():
            with trio.move_on_after(0.2):
                async with trio.open_nursery() as nursery:
                    for node in nodes:
                        nursery.start_soon(node.changed.wait)
                    await trio.sleep(0.2)
    return trio.current_time() - start


async def test_four_daemons_agree_on_membership_and_notice_leave_and_crash(tmp_path):
    nodes: list[Node] = []
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(40):
                first = await start_node(nursery, tmp_path, 0)
                nodes.append(first)
                await first.ready.wait()
                for i in (1, 2, 3):  # each joiner knows only the first node
                    nodes.append(
                        await start_node(nursery, tmp_path, i, "--admin", first.peer_id, "--connect", first.addr),
                    )
                for node in nodes:
                    await node.ready.wait()
            everyone = sorted(node.peer_id for node in nodes)
            join_time = await wait_until(lambda: all(n.live == everyone for n in nodes), nodes, timeout=10)
            assert join_time < 8

            leaver = nodes[3]
            os.kill(leaver.proc.pid, signal.SIGTERM)
            rest = [n for n in nodes if n is not leaver]
            remaining = sorted(n.peer_id for n in rest)
            leave_time = await wait_until(
                lambda: all(n.live == remaining and n.left == [leaver.peer_id] for n in rest), rest, timeout=LEASE
            )
            assert leave_time < LEASE - 0.5  # noticed through the pushed `left`, not the lease
            with trio.fail_after(5):
                assert await leaver.proc.wait() == 0

            crasher = rest[2]
            os.kill(crasher.proc.pid, signal.SIGKILL)
            survivors = rest[:2]
            alive = sorted(n.peer_id for n in survivors)
            crash_time = await wait_until(lambda: all(n.live == alive for n in survivors), survivors, timeout=LEASE + 6)
            assert crash_time > 1.0  # only the lease could tell
            assert all(n.left == [leaver.peer_id] for n in survivors)
            figures = {"join_s": round(join_time, 2), "leave_s": round(leave_time, 2), "crash_s": round(crash_time, 2)}
            print(json.dumps(figures))
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            if node.proc.returncode is None:
                os.kill(node.proc.pid, signal.SIGKILL)
                with trio.move_on_after(5):
                    await node.proc.wait()
