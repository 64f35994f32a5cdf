"""The daemon's side of a node's ranks: start them, give them orders, notice when one fails.

Theory of operation
-------------------
``LocalGroup.run`` (a trio service, started with ``nursery.start``) serves a ``TCPStore`` on
127.0.0.1 at a fresh port, starts one ``python -m lattica.train.engine.ranks.worker`` process per
device, sends each its ``init`` (the rendezvous under a fresh random key prefix — the
rendezvous travels on the rank's stdin, never on a command line other users can read) and
waits for every rank's ``ready``; then it unlinks the shared weights buffer's name (rank 0 has
mapped it) and reports started. ``phase`` and ``evaluate`` send an order to every rank and wait
for every answer, within a deadline the caller gives.

Failure: one reader task per rank turns its stdout into events, one watcher per rank turns its
exit into an event. The first failure event — an exit, the end of its output, an ``error``
answer, a malformed message, an order it can no longer receive — or a deadline that passes
without every answer fails the order with ``RankFailedError``. Since one rank's death breaks the
others' collectives a moment later, the events of a short grace period are gathered and the
root cause named: a rank killed by a signal before one that reported an error, before one that
exited without a word. A failed group is finished: the caller closes it (every rank process is
killed, by PID, and reaped) and starts a new one. The daemon itself never joins the process
group, so nothing a rank does can take it down.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_typing import TaskStatus

from lattica.errors import LatticaError, RankFailedError
from lattica.train.engine.ranks.messages import Message, MessageReader, encode
from lattica.train.engine.ranks.weights import SharedWeights

WORKER_MODULE = "lattica.train.engine.ranks.worker"


@dataclass(frozen=True, kw_only=True)
class GroupTimeouts:
    """How long the ranks may take (defaults in ``docs/reliability.md``)."""

    start_s: float = 300.0  # importing torch, building the task, forming the process group
    collective_s: float = 600.0  # torch.distributed's own timeout for one collective
    grace_s: float = 1.0  # after a first failure, how long the others' events are gathered

    def __post_init__(self) -> None:
        for name in ("start_s", "collective_s", "grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GroupTimeouts.{name} must be a finite positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """What every rank is told besides its own number and device."""

    devices: tuple[str, ...]
    init: dict[str, Any]  # settings, schedule, peer id, parameter layout… (``worker.Rank``)
    threads_per_rank: int = 1
    timeouts: GroupTimeouts = field(default_factory=GroupTimeouts)


@dataclass(frozen=True)
class _Event:
    rank: int
    kind: str  # "message", "eof", "exit", "broken"
    message: Message | None = None
    detail: str = ""


class LocalGroup:
    """The rank processes of one node, for as long as ``run`` runs (module docstring)."""

    def __init__(self, spec: GroupSpec, weights: SharedWeights) -> None:
        self.spec, self.weights = spec, weights
        self.procs: list[trio.Process] = []
        self.ready: dict[int, Message] = {}
        self._send_events, self._events = trio.open_memory_channel[_Event](math.inf)
        self._scope: trio.CancelScope | None = None
        self.closed = trio.Event()

    @property
    def world(self) -> int:
        return len(self.spec.devices)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from torch._C._distributed_c10d import (
            TCPStore,  # torch.distributed's, not re-exported for mypy
        )

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        prefix = f"lattica/{secrets.token_hex(16)}/"
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    for rank in range(self.world):
                        proc = await trio.lowlevel.open_process(
                            [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=self._environment(rank),
                        )
                        self.procs.append(proc)
                        nursery.start_soon(self._read, rank, proc)
                        nursery.start_soon(self._watch, rank, proc)
                    for rank in range(self.world):
                        await self._send(rank, self._init(rank, store.port, prefix))
                    answers = await self._answers("ready", self.spec.timeouts.start_s, what="start")
                    self.ready = dict(enumerate(answers))
                    self.weights.unlink()  # mapped by rank 0: no name is left behind
                    task_status.started()
                    await trio.sleep_forever()
        except BaseExceptionGroup as group:
            raise unwrapped(group) from None
        finally:
            with trio.CancelScope(shield=True):
                await self._kill_all()
            self.weights.unlink()
            del store
            self.closed.set()

    async def close(self) -> None:
        """End every rank process and wait until they are reaped."""
        if self._scope is not None:
            self._scope.cancel()
        await self.closed.wait()

    # ------------------------------------------------------------------ orders

    async def phase(self, first: int, last: int, sampler: bytes | None, *, deadline_s: float) -> list[Message]:
        """Inner steps ``first + 1 … last`` on every rank; their answers in rank order."""
        for rank in range(self.world):
            await self._send(rank, {"op": "phase", "first": first, "last": last, "sampler": sampler})
        return await self._answers("done", deadline_s, what=f"the phase of steps {first + 1}-{last}")

    async def evaluate(self, *, deadline_s: float) -> float:
        for rank in range(self.world):
            await self._send(rank, {"op": "evaluate"})
        answers = await self._answers("evaluated", deadline_s, what="the validation")
        return float(answers[0]["loss"])

    # ------------------------------------------------------------------ plumbing

    def _init(self, rank: int, port: int, prefix: str) -> Message:
        init = {**self.spec.init, "op": "init", "rank": rank, "world": self.world, "device": self.spec.devices[rank],
                "store_port": port, "prefix": prefix, "threads": self.spec.threads_per_rank,
                "timeout_s": self.spec.timeouts.collective_s}
        if rank == 0:
            init["weights_path"] = str(self.weights.path)
        return init

    def _environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",  # the process group stays on loopback
            "OMP_NUM_THREADS": str(self.spec.threads_per_rank),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "LATTICA_RANK": str(rank),
            "LATTICA_RANK_PARENT": str(os.getpid()),  # the rank dies with this process
        })
        return env

    async def _send(self, rank: int, message: Message) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        try:
            await stdin.send_all(encode(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send_events.send(_Event(rank, "broken", detail="stopped reading its orders"))

    async def _read(self, rank: int, proc: trio.Process) -> None:
        reader, stdout = MessageReader(), proc.stdout
        assert stdout is not None
        while True:
            try:
                data = await stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                await self._send_events.send(_Event(rank, "eof", detail="closed its output"))
                return
            try:
                messages = reader.feed(data)
            except LatticaError as exc:
                await self._send_events.send(_Event(rank, "broken", detail=str(exc)))
                return
            for message in messages:
                await self._send_events.send(_Event(rank, "message", message))

    async def _watch(self, rank: int, proc: trio.Process) -> None:
        code = await proc.wait()
        await self._send_events.send(_Event(rank, "exit", detail=_exit_reason(code)))

    async def _answers(self, op: str, deadline_s: float, *, what: str) -> list[Message]:
        """Every rank's ``op`` answer, or ``RankFailedError`` naming the root cause."""
        answers: dict[int, Message] = {}
        with trio.move_on_after(deadline_s):
            while len(answers) < self.world:
                event = await self._events.receive()
                if event.kind == "message" and event.message is not None and event.message.get("op") == op:
                    answers[event.rank] = event.message
                elif event.kind == "message" and event.message is not None and event.message.get("op") != "error":
                    detail = f"answered {event.message.get('op')!r}"
                    await self._send_events.send(_Event(event.rank, "broken", detail=detail))
                else:
                    raise await self._root_cause(event)
            return [answers[rank] for rank in range(self.world)]
        silent = min(set(range(self.world)) - set(answers))
        raise self._failure(silent, f"no answer to {what} within {deadline_s:.0f} s (hung?)")

    async def _root_cause(self, first: _Event) -> RankFailedError:
        events = [first]
        with trio.move_on_after(self.spec.timeouts.grace_s):
            while True:
                events.append(await self._events.receive())
        failures = [e for e in events if e.kind != "message" or (e.message or {}).get("op") == "error"]
        cause = min(failures, key=_blame_order)
        if cause.kind == "message":
            return self._failure(cause.rank, str((cause.message or {}).get("message", "failed")))
        if cause.kind == "eof":  # its exit, if it came, says more
            exits = [e for e in failures if e.kind == "exit" and e.rank == cause.rank]
            cause = exits[0] if exits else cause
        return self._failure(cause.rank, cause.detail)

    def _failure(self, rank: int, reason: str) -> RankFailedError:
        return RankFailedError(reason, rank=rank, device=self.spec.devices[rank])

    async def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()  # SIGKILL to this rank's own PID
        with trio.move_on_after(10):
            for proc in self.procs:
                await proc.wait()


def unwrapped(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """A nursery's one ``Exception`` as itself (the caller catches ``RankFailedError``); the
    group itself otherwise."""
    if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
        return group.exceptions[0]
    return group


def _blame_order(event: _Event) -> int:
    """Lower is more likely the root cause (module docstring)."""
    if event.kind == "exit" and event.detail.startswith("killed"):
        return 0
    if event.kind == "message":
        return 1
    if event.kind in ("broken", "exit"):
        return 2
    return 3  # the end of its output: the exit says why


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with status {code}"


def threads_per_rank(devices: Sequence[str]) -> int:
    """CPU ranks share the cores; a CUDA rank keeps a few for its host work."""
    cores = os.cpu_count() or 1
    if devices and devices[0].startswith("cuda"):
        return max(1, min(4, cores // len(devices)))
    return max(1, cores // len(devices))
