"""The next batches, drawn and moved to the training device while the current step runs.

Theory of operation
-------------------
A ``BatchPrefetcher`` owns one producer thread for the length of a training run. It draws
batches from the task's iterator in order, checks their shape, and on CUDA copies them into
pinned host memory and on to the device with ``non_blocking=True`` on its own CUDA stream,
recording an event after the copy. It keeps at most ``depth`` prepared batches in a bounded
queue, so it never runs further ahead than that. The trainer's worker thread takes them with
``next()``: its stream waits for the batch's event (on the device, not the host), and the
batch's memory is marked as used by that stream, so the allocator does not hand it out while
a step still reads it.

Order and resumption: batches come out in the order the iterator yields them, so a run is
the same with or without prefetching. The producer is ahead of the steps, so the sampler's
live state is too: each batch carries the sampler's state right after it was drawn, and
``resume_state`` is the state after the last batch a step took — what a checkpoint must hold
for a resumed run to draw the batches an uninterrupted one would.

Failures: an error of the iterator (or its end) is handed to the consumer in the batch's
place and raised there, where the step number is known; the producer then stops. ``close``
stops the producer and waits for it (it is blocked at most on one ``next()`` of the
iterator, which is the task's own). With ``depth = 0`` there is no thread: ``next()`` draws
and moves the batch itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lattica.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
_POLL_S = 0.1


class SamplerState(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class _Prepared:
    batch: Batch
    sampler_state: Mapping[str, Any] | None  # the sampler's state after this batch was drawn
    ready: torch.cuda.Event | None  # recorded on the copy stream after the copy to the device


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class BatchesEnded(Exception):
    """The task's iterator of training batches stopped."""


class BatchPrefetcher:
    """``next()`` returns the next batch on ``device`` (module docstring)."""

    def __init__(
        self, batches: Iterator[object], device: torch.device, *, depth: int = 2, sampler: SamplerState | None = None,
    ) -> None:
        if depth < 0:
            raise ValueError(f"BatchPrefetcher.depth must be >= 0, got {depth}")
        self._batches, self._device, self._sampler, self.depth = batches, device, sampler, depth
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda and depth else None  # type: ignore[no-untyped-call]  # unannotated in torch
        self._queue: queue.Queue[_Prepared | _Failed] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self.resume_state = _copy_state(sampler)  # after the last batch taken
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._produce, name="lattica-batches", daemon=True)
            self._thread.start()

    def next(self) -> Batch:
        """The next batch on the device (blocking); ``BatchesEnded`` when the iterator ended,
        ``ConfigError`` for a batch that is not an ``(x, y)`` pair of tensors."""
        item = self._prepare() if self._thread is None else self._take()
        if isinstance(item, _Failed):
            raise item.error
        if item.sampler_state is not None:
            self.resume_state = item.sampler_state
        x, y = item.batch
        if item.ready is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(item.ready)
            x.record_stream(stream)
            y.record_stream(stream)
        return x, y

    def close(self) -> None:
        """Stop the producer and wait for it; batches it prepared are dropped."""
        self._stop.set()
        thread, self._thread = self._thread, None
        while thread is not None and thread.is_alive():
            _drain(self._queue)
            thread.join(_POLL_S)

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _take(self) -> _Prepared | _Failed:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    return _Failed(BatchesEnded("the batch producer stopped"))

    def _produce(self) -> None:
        while not self._stop.is_set():
            item = self._prepare()
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failed):
                return

    def _prepare(self) -> _Prepared | _Failed:
        try:
            batch = next(self._batches)
        except StopIteration:
            return _Failed(BatchesEnded("the task's train_batches ran out"))
        except BaseException as exc:  # noqa: BLE001 - the task's iterator may raise anything: raised by next()
            return _Failed(exc)
        if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
            return _Failed(ConfigError("the task's train_batches must yield (x, y) tuples of tensors"))
        state = _copy_state(self._sampler)
        try:
            moved, ready = self._to_device(batch[0], batch[1])
        except (RuntimeError, ValueError) as exc:
            return _Failed(exc)
        return _Prepared(moved, state, ready)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Batch, torch.cuda.Event | None]:
        if self._stream is None:
            return (x.to(self._device), y.to(self._device)), None
        with torch.cuda.stream(self._stream):
            moved = (_pinned(x).to(self._device, non_blocking=True), _pinned(y).to(self._device, non_blocking=True))
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event unannotated
            ready.record(self._stream)
        return moved, ready


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type != "cpu" or tensor.is_pinned() else tensor.pin_memory()


def _copy_state(sampler: SamplerState | None) -> Mapping[str, Any] | None:
    if sampler is None:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sampler.state_dict().items()}


def _drain(items: queue.Queue[Any]) -> None:
    while True:
        try:
            items.get_nowait()
        except queue.Empty:
            return


def prefetch_depth(device: torch.device) -> int:
    """Batches prepared ahead: on CUDA two (copied while steps run); on the CPU none: drawing a
    batch of the built-in sampler takes ~0.03 ms against 15-100 ms for a step of ``tiny`` or
    ``mini``, and a producer thread was measured no faster there (docs/training.md)."""
    return 2 if device.type == "cuda" else 0
