"""4-bit float quantization with a scale per block, for Streaming DiLoCo's outer gradients.

Streaming DiLoCo (Douillard et al., 2025) sends pseudo-gradients as 4-bit floats and reduces them
in fp32. We use the E2M1 grid (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and a sign bit): each block
of ``block_size`` consecutive values is divided by its own scale ``absmax / 6`` and rounded to the
nearest grid point. Two codes share one byte; the scales travel as fp32.

Invariants:
- ``dequantize_4bit(quantize_4bit(x))`` differs from ``x`` by at most ``scale`` per element
  (half the widest grid gap, 4 -> 6), and the block's absmax is represented exactly.
- A block of zeros has scale 0 and decodes to zeros.
- Sums are never taken on codes: ``mean_of_quantized`` dequantizes each contribution to fp32
  first, which is what "reduce in fp32" means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (_GRID[1:] + _GRID[:-1]) / 2
_GRID_MAX = 6.0
_SIGN_BIT = 8

DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True, kw_only=True)
class Quantized4Bit:
    """A tensor encoded as packed 4-bit codes plus one fp32 scale per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    block_size: int

    @property
    def nbytes(self) -> int:
        """Bytes this encoding occupies on the wire."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


def encoded_size_4bit(numel: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Wire bytes of ``numel`` values: half a byte each (padded to whole blocks) plus scales."""
    blocks = math.ceil(numel / block_size)
    return blocks * block_size // 2 + blocks * 4


def quantize_4bit(tensor: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Quantized4Bit:
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    flat = tensor.detach().to(torch.float32).flatten()
    blocks = _pad_to_blocks(flat, block_size)
    scales = blocks.abs().amax(dim=1) / _GRID_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = (blocks / safe[:, None]).clamp(-_GRID_MAX, _GRID_MAX)
    magnitude_index = torch.bucketize(scaled.abs(), _MIDPOINTS)
    codes = magnitude_index.to(torch.uint8) | (scaled < 0).to(torch.uint8) * _SIGN_BIT
    pairs = codes.flatten().view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return Quantized4Bit(codes=packed, scales=scales, shape=tensor.shape, block_size=block_size)


def dequantize_4bit(quantized: Quantized4Bit) -> torch.Tensor:
    """The fp32 tensor the codes stand for."""
    low = quantized.codes & 0x0F
    high = quantized.codes >> 4
    codes = torch.stack([low, high], dim=1).flatten().long()
    magnitude = _GRID[codes & 0x7]
    values = torch.where(codes & _SIGN_BIT > 0, -magnitude, magnitude)
    blocks = values.view(-1, quantized.block_size) * quantized.scales[:, None]
    numel = math.prod(quantized.shape)
    return blocks.flatten()[:numel].view(quantized.shape)


def roundtrip_4bit(tensor: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """What a peer receives when ``tensor`` is sent 4-bit: fp32, same shape."""
    return dequantize_4bit(quantize_4bit(tensor, block_size=block_size))


def mean_of_quantized(contributions: Sequence[Quantized4Bit]) -> torch.Tensor:
    """Element-wise mean of several encodings, each dequantized and summed in fp32."""
    if not contributions:
        raise ValueError("need at least one contribution")
    total = torch.zeros(contributions[0].shape, dtype=torch.float32)
    for contribution in contributions:
        total += dequantize_4bit(contribution)
    return total / len(contributions)


def _pad_to_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    padding = (-flat.numel()) % block_size
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(-1, block_size)
