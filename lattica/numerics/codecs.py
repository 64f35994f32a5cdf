"""Tensor codecs: how one tensor becomes a header (``TensorSpec``) plus raw payload bytes.

Sans-IO and pickle-free. The header names the original dtype, shape and codec; the payload
layout follows from it alone, so a receiver knows the exact payload size *before* it allocates
anything and refuses a header that lies.

Codecs (``codec`` applies to floating tensors; integer and bool tensors always travel ``raw``):

======  =====================================  =============================================
codec   payload                                error bound (per element, finite inputs)
======  =====================================  =============================================
raw     the tensor's own bytes                 bit-exact, any supported dtype
fp32    float32                                bit-exact for fp32 (fp64: rounding to fp32)
fp16    float16                                relative 2**-11; |x| > 65504 becomes inf
bf16    bfloat16                               relative 2**-8
int8    fp32 scale per 64-element block +      ``absmax(block) / 254`` (round to nearest of
        int8 values in [-127, 127]             127 steps of size absmax/127)
int4    fp32 scale per 64-element block +      ``absmax(block) / 14`` (15 levels -7..7,
        two 4-bit values per byte              stored with an offset of 8)
======  =====================================  =============================================

The quantizing codecs refuse non-finite input (a NaN would poison a whole block's scale).
Sums of decoded tensors are always taken in fp32 by the callers. ``ErrorFeedback`` keeps the
quantization residual of each named tensor and adds it back before the next encoding.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from lattica.errors import LocalProtocolError, RemoteProtocolError

BLOCK = 64
MAX_NDIM = 32
MAX_NUMEL = 1 << 40
MAX_NAME = 1024

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_FLOAT_WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CODECS = ("raw", "fp32", "fp16", "bf16", "int8", "int4")
LOSSY = ("fp16", "bf16", "int8", "int4")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a receiver learns from the header: enough to size and decode the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_size(self) -> int:
        n = self.numel
        if self.codec == "raw":
            return n * DTYPES[self.dtype].itemsize
        if self.codec in _FLOAT_WIRE:
            return n * _FLOAT_WIRE[self.codec].itemsize
        scales = 4 * _blocks(n)
        return scales + (n if self.codec == "int8" else (n + 1) // 2)

    def to_wire(self) -> list[str | list[int]]:
        return [self.name, self.dtype, list(self.shape), self.codec]


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise LocalProtocolError(f"unknown codec {codec!r}; expected one of {CODECS}")


def spec_from_wire(obj: object, *, peer_id: str | None = None) -> TensorSpec:
    """Validate an untrusted header entry; any inconsistency is a ``RemoteProtocolError``."""

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"invalid tensor header: {why}", peer_id=peer_id)

    if not isinstance(obj, list) or len(obj) != 4:
        raise bad("expected [name, dtype, shape, codec]")
    name, dtype, shape, codec = obj
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise bad("name")
    if dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    if codec not in CODECS:
        raise bad(f"unknown codec {codec!r}")
    if codec != "raw" and not DTYPES[dtype].is_floating_point:
        raise bad(f"codec {codec} on non-float dtype {dtype}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise bad("shape")
    if not all(type(d) is int and 0 <= d <= MAX_NUMEL for d in shape):
        raise bad("shape dimensions")
    spec = TensorSpec(name, dtype, tuple(shape), codec)
    if spec.numel > MAX_NUMEL:
        raise bad("too many elements")
    return spec


def effective_codec(tensor: torch.Tensor, codec: str) -> str:
    check_codec(codec)
    if tensor.dtype not in _DTYPE_NAMES:
        raise LocalProtocolError(f"unsupported dtype {tensor.dtype}")
    return codec if tensor.dtype.is_floating_point else "raw"


def spec_of(tensor: torch.Tensor, codec: str, name: str = "") -> TensorSpec:
    codec = effective_codec(tensor, codec)
    return TensorSpec(name, _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), codec)


def encoded_size(tensor: torch.Tensor, codec: str) -> int:
    return spec_of(tensor, codec).payload_size


def encode(tensor: torch.Tensor, codec: str, name: str = "") -> tuple[TensorSpec, memoryview]:
    """Encode ``tensor``; the payload may share memory with it (do not mutate until sent)."""
    spec = spec_of(tensor, codec, name)
    flat = tensor.detach().reshape(-1)
    if spec.codec == "raw":
        payload = _bytes_of(flat)
    elif spec.codec in _FLOAT_WIRE:
        payload = _bytes_of(flat.to(_FLOAT_WIRE[spec.codec]))
    else:
        payload = _quantize(flat.to(torch.float32), bits=8 if spec.codec == "int8" else 4)
    return spec, payload


def decode(
    spec: TensorSpec, payload: bytes | bytearray | memoryview, *, peer_id: str | None = None
) -> torch.Tensor:
    """Rebuild the tensor described by ``spec`` (in its original dtype)."""
    if len(payload) != spec.payload_size:
        raise RemoteProtocolError(
            f"payload of {len(payload)} bytes, header announced {spec.payload_size}",
            peer_id=peer_id,
        )
    dtype = DTYPES[spec.dtype]
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=dtype)
    raw = _as_uint8(payload)
    if spec.codec == "raw":
        flat = raw.view(dtype)
    elif spec.codec in _FLOAT_WIRE:
        flat = raw.view(_FLOAT_WIRE[spec.codec]).to(dtype)
    else:
        bits = 8 if spec.codec == "int8" else 4
        flat = _dequantize(raw, spec.numel, bits=bits, peer_id=peer_id).to(dtype)
    return flat.reshape(spec.shape)


def roundtrip(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """What the receiver of ``encode(tensor, codec)`` gets back (in the original dtype)."""
    spec, payload = encode(tensor, codec)
    return decode(spec, bytearray(payload))


class ErrorFeedback:
    """Per-name quantization residuals: send ``x + e``, keep ``e <- (x + e) - decoded``."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, tensor: torch.Tensor, codec: str) -> torch.Tensor:
        """Return the tensor to hand to the codec, updating the stored residual."""
        x = tensor.detach().to(torch.float32)
        residual = self._residuals.get(name)
        if residual is not None and residual.shape == x.shape:
            x = x + residual
        self._residuals[name] = x - roundtrip(x, codec).to(torch.float32)
        return x.to(tensor.dtype)

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, writable and shared (no copy)."""
    if not tensor.is_contiguous():
        raise LocalProtocolError("byte_view needs a contiguous tensor")
    return _bytes_of(tensor)


def writable_buffer(nbytes: int) -> memoryview:
    """An uninitialized receive buffer (no zero-fill: only the incoming bytes touch its pages)."""
    if nbytes == 0:
        return memoryview(bytearray())
    return _bytes_of(torch.empty(nbytes, dtype=torch.uint8))


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _bytes_of(flat: torch.Tensor) -> memoryview:
    # A zero-copy view of the tensor's memory (numpy is not a dependency): a ctypes array over
    # its data pointer, which holds a reference to the tensor to keep that memory alive.
    flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    array._owner = flat  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _as_uint8(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
        payload = bytearray(payload)
    return torch.frombuffer(payload, dtype=torch.uint8)


def _quantize(x: torch.Tensor, *, bits: int) -> memoryview:
    n = x.numel()
    levels = 127 if bits == 8 else 7
    nblocks = _blocks(n)
    padded = torch.zeros(nblocks * BLOCK, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nblocks, BLOCK)
    scale = blocks.abs().amax(dim=1) / levels
    if not bool(torch.isfinite(scale).all()):
        raise LocalProtocolError("cannot quantize non-finite values")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).reshape(-1)
    if bits == 8:
        values = q[:n].to(torch.int8).view(torch.uint8)
    else:
        nib = (q + 8).to(torch.uint8).view(-1, 2)
        values = (nib[:, 0] | (nib[:, 1] << 4))[: (n + 1) // 2]
    out = torch.cat([scale.view(torch.uint8), values.contiguous()])
    return _bytes_of(out)


def _dequantize(raw: torch.Tensor, n: int, *, bits: int, peer_id: str | None) -> torch.Tensor:
    nblocks = _blocks(n)
    scale = raw[: 4 * nblocks].clone().view(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise RemoteProtocolError("invalid quantization scale", peer_id=peer_id)
    values = raw[4 * nblocks :]
    if bits == 8:
        q = values.view(torch.int8).to(torch.float32)
    else:
        pairs = torch.stack([values & 0x0F, values >> 4], dim=1).reshape(-1)[:n]
        q = pairs.to(torch.float32) - 8
    padded = torch.zeros(nblocks * BLOCK, dtype=torch.float32)
    padded[:n] = q
    return (padded.view(nblocks, BLOCK) * scale[:, None]).reshape(-1)[:n]
