"""One rank of a node: a process per local device, started by the daemon (``group.py``).

Theory of operation
-------------------
``python -m lattica.train.engine.ranks.worker`` reads its orders on stdin and answers on stdout
(``messages.py``); its logs and tracebacks go to stderr, the daemon's log. It dies with the
daemon (a watcher thread polls its parent: ``PR_SET_PDEATHSIG`` fires when the *thread* that
started the process ends, and trio starts processes from worker threads that end after a few idle
seconds) and ends when its stdin closes.

1. ``init``: the rank, the world size, its device, the run settings and the node's peer id, the
   rendezvous (a ``TCPStore`` the daemon serves on 127.0.0.1 at a fresh port; every key under a
   fresh random prefix, so only processes told the prefix meet there) and, for rank 0, the
   shared weights buffer. It builds the same task as a one-device node
   (``trainer_factory.build_task``: same model, same data, same sampler seed), forms the
   process group (NCCL on CUDA, gloo on the CPU, bound to loopback), wraps the model in
   ``DistributedDataParallel`` and answers ``ready``.
2. ``phase`` (steps ``first + 1 … last``, the sampler's state): rank 0 loads the node's
   weights from the shared buffer and broadcasts them; every rank loads the sampler state, so
   all ranks draw the same windows of the node's batch and each reads its own rows of it
   (``rows``). Each step: the learning rate of the schedule, forward/backward (micro-batches
   with DDP's gradient all-reduce only on the last), gradient clipping on the averaged
   gradients, the inner optimizer. The node's batch is the same as a one-rank node's, so the
   ranks together take the step a one-rank node would (up to float rounding). At the end the
   ranks compare a fingerprint of their weights (integer sums of the bits, all-reduced as max
   and min: equal only if every rank holds the same bits), rank 0 writes the weights back to
   the buffer and every rank answers ``done`` with its figures (rank 0: the node's loss, the
   sampler's state, whether the ranks agree).
3. ``evaluate``: the weights from the buffer, as for a phase; each rank validates every N-th
   batch and the sums are all-reduced; rank 0 answers with the mean over batches.

An exception is answered with ``error`` (its first line) before the process exits non-zero;
a collective whose peer died raises here too (gloo), or hangs until the daemon kills the
rank (its phase deadline).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # torch.distributed's, not re-exported for mypy
    PrefixStore,
    TCPStore,
)
from torch.nn.parallel import DistributedDataParallel

from lattica.config import TrainSettings
from lattica.errors import LatticaError
from lattica.train.engine.activation_checkpoint import checkpoint_layers
from lattica.train.engine.compiled_model import ForwardModule, compile_enabled
from lattica.train.engine.device import DeviceInfo, autocast, select_device
from lattica.train.engine.inner_optimizer import build_adamw
from lattica.train.engine.ranks.messages import Message, MessageReader, encode
from lattica.train.engine.ranks.weights import Layout, SharedWeights
from lattica.train.engine.schedule import ScheduleConfig, lr_multiplier
from lattica.train.engine.task import Batch, Task
from lattica.train.engine.utilization import device_peak_flops, mfu, model_flops_per_token

_PARENT_POLL_S = 0.5


class Channel:
    """Blocking message I/O over the rank's stdin and a private duplicate of its stdout."""

    def __init__(self, incoming: BinaryIO, outgoing: BinaryIO) -> None:
        self.incoming, self.outgoing = incoming, outgoing
        self.reader = MessageReader()
        self.pending: list[Message] = []

    def receive(self) -> Message | None:
        while not self.pending:
            data = self.incoming.read1(1 << 16) if hasattr(self.incoming, "read1") else self.incoming.read(1 << 16)
            if not data:
                return None
            self.pending.extend(self.reader.feed(data))
        return self.pending.pop(0)

    def send(self, message: Message) -> None:
        self.outgoing.write(encode(message))
        self.outgoing.flush()


class Rank:
    """This process's share of the node's training (module docstring)."""

    def __init__(self, init: Message, channel: Channel) -> None:
        self.channel = channel
        self.rank, self.world = int(init["rank"]), int(init["world"])
        self.name = str(init["device"])
        self.info = _device_info(self.name)
        settings = TrainSettings(**init["settings"])
        self.schedule = ScheduleConfig(**init["schedule"])
        self.grad_clip, self.micro_batches = float(init["grad_clip"]), settings.micro_batches
        self.task: Task = _task_builder(str(init["task_builder"]))(settings, peer_id=str(init["peer_id"]))
        rows = settings.batch_size // self.world
        self.rows = slice(self.rank * rows, (self.rank + 1) * rows)
        self.model = self.task.model.to(self.info.device)
        if settings.activation_checkpointing:
            checkpoint_layers(self.model)
        self.params = list(self.model.parameters())
        self._join_group(init)
        ids = [self.info.device.index] if self.info.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids, broadcast_buffers=False)
        self.forward = ForwardModule(self.ddp, compile=compile_enabled(settings.compile, self.info.device))
        self.optimizer = self.task.optimizer or build_adamw(
            [p for p in self.params if p.requires_grad], device=self.info.device,
            lr=self.schedule.lr, weight_decay=float(init["weight_decay"]),
        )
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.weights: SharedWeights | None = None
        if self.rank == 0:
            layout = Layout(tuple(init["layout"]["offsets"]), int(init["layout"]["nbytes"]))
            if Layout.of(self.params) != layout:
                raise ValueError("this rank's model does not match the daemon's (parameter layout differs)")
            self.weights = SharedWeights(Path(init["weights_path"]), layout)
        self._peak = device_peak_flops(self.info)
        self._flops_per_token: float | None = None

    def _join_group(self, init: Message) -> None:
        timeout = datetime.timedelta(seconds=float(init["timeout_s"]))
        store = TCPStore("127.0.0.1", int(init["store_port"]), is_master=False, timeout=timeout)
        prefixed = PrefixStore(str(init["prefix"]), store)
        backend = "nccl" if self.info.device.type == "cuda" else "gloo"
        if self.info.device.type == "cuda":
            torch.cuda.set_device(self.info.device)
        dist.init_process_group(backend, store=prefixed, rank=self.rank, world_size=self.world, timeout=timeout)

    # ------------------------------------------------------------------ orders

    def serve(self) -> None:
        self.channel.send({"op": "ready", "rank": self.rank, "device": self.info.describe()})
        while (order := self.channel.receive()) is not None:
            if order["op"] == "phase":
                self.channel.send(self.phase(int(order["first"]), int(order["last"]), order.get("sampler")))
            elif order["op"] == "evaluate":
                self.channel.send(self.evaluate())
            else:
                raise ValueError(f"unknown order {order['op']!r}")

    def phase(self, first: int, last: int, sampler: bytes | None) -> Message:
        self._load_sampler(sampler)
        self._receive_weights()
        started, tokens = time.monotonic(), 0
        loss = torch.zeros((), device=self.info.device)
        for step in range(first, last):
            self._set_lr(step)
            x, y = self._next_batch()
            loss = self._step(x, y)
            tokens += y.numel()
        node_loss = loss.detach().float().clone()
        dist.all_reduce(node_loss)
        agree = self._ranks_agree()
        seconds = max(time.monotonic() - started, 1e-9)  # the collectives waited for the device
        answer: Message = {
            "op": "done", "rank": self.rank, "loss": float(node_loss) / self.world, "agree": agree,
            "tokens": tokens, "seconds": seconds, **self._figures(tokens / seconds),
        }
        if self.weights is not None:
            self.weights.store(self.params)
            if self.task.sampler is not None:
                answer["sampler"] = _sampler_bytes(self.task.sampler.state_dict()["generator"])
        return answer

    def evaluate(self) -> Message:
        self._receive_weights()
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        try:
            with torch.no_grad():
                for x, y in list(self.task.val_batches)[self.rank :: self.world]:
                    with autocast(self.info):
                        loss = self.task.loss_fn(self.model, x.to(self.info.device), y.to(self.info.device))
                    totals[0] += loss.detach().double()
                    totals[1] += 1
        finally:
            self.model.train()
        dist.all_reduce(totals)
        count = float(totals[1])
        return {"op": "evaluated", "rank": self.rank, "loss": float(totals[0]) / count if count else float("nan")}

    # ------------------------------------------------------------------ pieces

    def _receive_weights(self) -> None:
        """Rank 0 takes the node's weights from the shared buffer; every rank gets its bits."""
        if self.weights is not None:
            self.weights.load(self.params)
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=0)

    def _load_sampler(self, state: bytes | None) -> None:
        if state is not None and self.task.sampler is not None:
            self.task.sampler.load_state_dict({"generator": torch.frombuffer(bytearray(state), dtype=torch.uint8)})

    def _next_batch(self) -> Batch:
        if self.task.sampler is not None:
            x, y = self.task.sampler.next_batch(self.rows)
        else:  # a user task: every rank draws the node's batch and keeps its rows
            x, y = next(self.task.train_batches)
            x, y = x[self.rows], y[self.rows]
        if self._flops_per_token is None and y.dim() >= 2:
            self._flops_per_token = model_flops_per_token(self.model, seq_len=y.shape[-1])
        return x.to(self.info.device, non_blocking=True), y.to(self.info.device, non_blocking=True)

    def _set_lr(self, step: int) -> None:
        factor = lr_multiplier(step, self.schedule)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = base * factor

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.train()
        loss = self.forward.run(lambda module: self._backward(module, x, y), on_retry=self._drop_gradients)
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _backward(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The slice's mean loss and its gradient, averaged over the ranks by DDP in the last
        micro-batch's backward (the others accumulate locally: ``no_sync``)."""
        parts = [(xp, yp) for xp, yp in zip(x.tensor_split(self.micro_batches), y.tensor_split(self.micro_batches),
                                            strict=True) if len(xp)]
        total = torch.zeros((), device=self.info.device)
        for i, (xp, yp) in enumerate(parts):
            quiet = self.ddp.no_sync() if i < len(parts) - 1 else contextlib.nullcontext()
            with quiet:
                with autocast(self.info):
                    loss = self.task.loss_fn(module, xp, yp)
                weighted = loss * (len(xp) / len(x))
                weighted.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            total = total + weighted.detach()
        return total

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _ranks_agree(self) -> bool:
        """Whether every rank holds the same bits (module docstring)."""
        mine = _fingerprint(self.params, self.info.device)
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return bool(torch.equal(high, low))

    def _figures(self, tokens_per_s: float) -> dict[str, object]:
        if self.info.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.info.device)
        else:  # the process's peak resident memory (KiB on Linux)
            memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        figures: dict[str, object] = {
            "device": self.info.describe(), "name": self.name, "tokens_per_s": tokens_per_s, "memory_bytes": memory,
            "peak_flops": self._peak, "flops_per_token": self._flops_per_token,
        }
        utilization = mfu(self._flops_per_token, tokens_per_s, self._peak)
        if utilization is not None:
            figures["mfu"] = utilization
        return figures


def _fingerprint(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Two integer sums over the bits of every parameter (wrapping int64): exact, so equal on
    every rank that holds the same bits, whatever order the device adds in."""
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for p in params:
        bits = p.detach().contiguous().view(_INT_OF_SIZE[p.element_size()]).reshape(-1).to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * bits).sum()
    return total


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sampler_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.contiguous().numpy().tobytes())


def _device_info(name: str) -> DeviceInfo:
    if name.startswith("cuda"):
        return select_device(name)
    return DeviceInfo(torch.device("cpu"), None)


def _die_with_parent() -> None:
    """This process is killed when the daemon that started it dies, even mid-collective.

    The daemon names itself in ``LATTICA_RANK_PARENT``; a daemon thread compares the parent's
    pid with it twice a second (a collective in C++ releases the GIL, so it runs then too).
    """
    expected = int(os.environ.get("LATTICA_RANK_PARENT", os.getppid()))

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(_PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lattica-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _private_stdout() -> Iterator[BinaryIO]:
    """The messages get a duplicate of stdout; fd 1 itself then points at stderr, so a print
    (or a library's) cannot corrupt the channel."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    try:
        yield out
    finally:
        out.close()


def main() -> int:
    _die_with_parent()
    with _private_stdout() as out:
        channel = Channel(sys.stdin.buffer, out)
        init = channel.receive()
        if init is None or init.get("op") != "init":
            return 2
        torch.set_num_threads(max(1, int(init.get("threads", 1))))
        try:
            Rank(init, channel).serve()
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - answered to the daemon, which names the rank
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"rank {init.get('rank')} failed", file=sys.stderr, flush=True)
            import traceback

            traceback.print_exc()
            with contextlib.suppress(OSError):
                message = f"{type(exc).__name__}: {first}"[:500]
                channel.send({"op": "error", "rank": init.get("rank"), "message": message})
            return 1  # no teardown: a collective with a dead peer could wait for it
    return 0




def _task_builder(spec: str) -> Callable[..., Task]:
    """The daemon's task builder, ``module:function`` (the worker knows nothing of settings)."""
    module, _, name = spec.partition(":")
    builder = getattr(importlib.import_module(module), name, None)
    if not callable(builder):
        raise LatticaError(f"no task builder {spec!r}")
    return cast(Callable[..., Task], builder)


if __name__ == "__main__":
    sys.exit(main())
