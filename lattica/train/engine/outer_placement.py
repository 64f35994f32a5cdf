"""Where the DiLoCo family keeps its outer state, and how that state meets the model.

Theory of operation
-------------------
The outer state — the outer weights φ, the outer momentum, SparseLoCo's error feedback, the
eager look-ahead — is fp32 and one to three times the model's size. The run setting
``outer_state_device`` says where it lives:

- ``"cpu"`` (the default): host memory, pinned when the model trains on CUDA. The outer math
  runs on the CPU in fp32, exactly as on a member that trains on the CPU, so members agree
  bit for bit whatever their accelerator, and the device holds none of it. The model's
  weights reach it in chunks (``pseudo_gradient``): θ is copied chunk by chunk into a pinned
  staging buffer of two halves — the device fills one while the CPU computes Δ = φ − θ on the
  other — so the host needs one chunk of staging, not a copy of the model, and the device
  nothing. Weights go back (``copy_into``: θ ← φ, or the look-ahead) as non-blocking copies
  from pinned memory, waited for once at the end.
- ``"same"``: the training device. The outer math runs there (faster for a large model on a
  GPU; it costs the state's size in device memory); what crosses the network is copied to
  the host first (``host_copies``), and what comes back goes to the device. On the CPU both
  placements are the same. Members agree bit for bit when they compute the outer step on the
  same kind of device: a run that mixes CPU and GPU members keeps ``"cpu"``.

Every function here computes the same values as the plain per-tensor expression it replaces
(Δ = φ − θ.to(φ), θ ← φ): an fp32 subtraction and a copy give the same bits in chunks or
whole, on either placement.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lattica.config import OUTER_STATE_DEVICES, OuterStateDevice

STAGING_CHUNK_BYTES = 16 << 20  # one half of the pinned staging buffer for θ on its way to the host


@dataclass(frozen=True, kw_only=True)
class OuterPlacement:
    """``where``: ``"cpu"`` or ``"same"`` (module docstring)."""

    where: OuterStateDevice = "cpu"

    def __post_init__(self) -> None:
        if self.where not in OUTER_STATE_DEVICES:
            raise ValueError(f"outer_state_device must be one of {', '.join(OUTER_STATE_DEVICES)}, got {self.where!r}")

    def device_for(self, params: Sequence[torch.Tensor]) -> torch.device:
        """Where the outer state of a model with ``params`` lives."""
        model_device = params[0].device if params else torch.device("cpu")
        return model_device if self.where == "same" else torch.device("cpu")

    def copy(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 copies of ``params`` where the outer state lives (pinned host memory for a
        model on CUDA under ``"cpu"``)."""
        device = self.device_for(params)
        pin = device.type == "cpu" and any(p.device.type == "cuda" for p in params)
        copies = []
        for p in params:
            target = torch.empty(p.shape, dtype=torch.float32, device=device, pin_memory=pin)
            target.copy_(p.detach())
            copies.append(target)
        return copies


def clone_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies on the same device, pinned where the originals are (``clone`` is not)."""
    out = []
    for t in tensors:
        copy = torch.empty(t.shape, dtype=t.dtype, device=t.device, pin_memory=_pinned(t))
        copy.copy_(t)
        out.append(copy)
    return out


def pseudo_gradient(outer: Sequence[torch.Tensor], inner: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ per tensor, in fp32 where φ lives; θ streamed to the host in chunks when φ
    is on the host and θ on CUDA."""
    if any(o.device.type == "cpu" and i.device.type == "cuda" for o, i in zip(outer, inner, strict=True)):
        return streamed_pseudo_gradient(outer, inner)
    return [o.detach() - i.detach().to(device=o.device, dtype=o.dtype) for o, i in zip(outer, inner, strict=True)]


def streamed_pseudo_gradient(
    outer: Sequence[torch.Tensor], inner: Sequence[torch.Tensor], *, chunk_bytes: int = STAGING_CHUNK_BYTES,
) -> list[torch.Tensor]:
    """Δ = φ − θ with φ on the host: θ copied in chunks through two staging halves, the copy of
    the next chunk running while the host subtracts this one (module docstring). Works for θ
    on any device; pinned staging and asynchronous copies on CUDA."""
    deltas = [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in outer]
    pieces = list(_pieces(inner, chunk_bytes))
    if not pieces:
        return deltas
    staging = _Staging(inner, chunk_bytes)
    staging.fill(0, pieces[0])
    for k, (index, start, stop) in enumerate(pieces):
        if k + 1 < len(pieces):
            staging.fill((k + 1) % 2, pieces[k + 1])
        theta = staging.wait(k % 2, inner[index].dtype, stop - start)
        outer_flat = outer[index].detach().reshape(-1)[start:stop]
        torch.sub(outer_flat, theta.to(outer_flat.dtype), out=deltas[index].view(-1)[start:stop])
    return deltas


def copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target ← source`` for each pair (θ ← φ); from pinned memory to CUDA asynchronously,
    waited for once at the end, so the sources may change as soon as this returns."""
    streams: set[torch.cuda.Stream] = set()
    with torch.no_grad():
        for target, source in zip(targets, sources, strict=True):
            asynchronous = target.device.type == "cuda" and _pinned(source)
            target.copy_(source, non_blocking=asynchronous)
            if asynchronous:
                streams.add(torch.cuda.current_stream(target.device))
    for stream in streams:
        stream.synchronize()


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host for the network: the tensors themselves when they are there."""
    return [t if t.device.type == "cpu" else t.detach().to("cpu") for t in tensors]


def host_clone(tensor: torch.Tensor) -> torch.Tensor:
    """An independent host copy (checkpoints, hashes, state served to joiners)."""
    return tensor.detach().to("cpu", copy=True)


def device_bytes(tensors: Sequence[torch.Tensor | None], device: torch.device) -> int:
    """Bytes of ``tensors`` held on ``device`` (the outer state's share of a device's memory)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device == device)


class _Staging:
    """Two halves of a staging buffer per dtype; on CUDA pinned, filled asynchronously."""

    def __init__(self, inner: Sequence[torch.Tensor], chunk_bytes: int) -> None:
        self._cuda = next((t.device for t in inner if t.device.type == "cuda"), None)
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._chunk_bytes = chunk_bytes
        self._inner = inner

    def fill(self, half: int, piece: tuple[int, int, int]) -> None:
        index, start, stop = piece
        source = self._inner[index].detach().reshape(-1)[start:stop]
        buffer = self._buffer(source.dtype, half)[: stop - start]
        asynchronous = source.device.type == "cuda"
        buffer.copy_(source, non_blocking=asynchronous)
        if asynchronous:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event unannotated
            event.record(torch.cuda.current_stream(source.device))
            self._events[half] = event

    def wait(self, half: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        event, self._events[half] = self._events[half], None
        if event is not None:
            event.synchronize()
        return self._buffer(dtype, half)[:count]

    def _buffer(self, dtype: torch.dtype, half: int) -> torch.Tensor:
        key = (dtype, half)
        if key not in self._buffers:
            elements = max(1, self._chunk_bytes // torch.empty((), dtype=dtype).element_size())
            self._buffers[key] = torch.empty(elements, dtype=dtype, pin_memory=self._cuda is not None)
        return self._buffers[key]


def _pieces(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """``(tensor index, start, stop)`` of flat ranges of at most ``chunk_bytes`` each."""
    for index, t in enumerate(tensors):
        step = max(1, chunk_bytes // t.element_size())
        for start in range(0, t.numel(), step):
            yield index, start, min(start + step, t.numel())


def _pinned(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and torch.cuda.is_available() and tensor.is_pinned()
