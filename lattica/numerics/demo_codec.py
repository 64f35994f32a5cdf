"""DeMo's wire codec: sparse DCT coefficients with integer-quantized values.

Sans-IO and pickle-free, like ``sparse.py``, whose chunk layout (``SparseChunks``: ``k`` sorted
entries of each chunk) and index schemes it reuses. ``fp16`` and ``fp32`` values (and
``sparse``'s ``2bit``) are ``sparse.encode``'s own segments; the ``int<b>`` codecs (b = 2 … 8)
are this module's. One ``int<b>`` segment is a single ``uint8`` tensor:

====================  ======================================================================
bytes                 content
====================  ======================================================================
16                    header: ``D``, version, b, index scheme, then chunk, k and the number
                      of chunks as little-endian uint32
4 per chunk           the chunk's fp32 scale s = absmax / L of its kept values, L = 2^(b−1) − 1
values                b bits per kept value, packed LSB first: the code round(v / s) + L, in
                      0 … 2L (a value is off by at most s / 2; the row's absmax is exact)
indices               ``sparse``'s index scheme named by the header (the smallest for the
                      layout), bits packed LSB first
====================  ======================================================================

DeMo steps by the sign of the mean of everyone's coefficients and keeps what it did not send
in its momentum (the sender removes the *decoded* values, ``quantized``), so the rounding error
is not lost: it stays in m and goes out with a later step. At int8 a value costs 8 bits instead
of fp16's 16, so the same bytes carry about 1.5× the coefficients.

``decode`` checks everything it reads against the layout the receiver expects (another model or
codec, a lying header, a wrong size, a code above 2L, a non-finite or negative scale, indices
out of range or repeated): any inconsistency is a ``RemoteProtocolError`` naming the peer.
"""

from __future__ import annotations

import torch

from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.numerics import sparse
from lattica.numerics.sparse import (  # the index schemes and bit packing are shared
    _decode_indices,
    _encode_indices,
    _pack_fixed,
    _unpack_fixed,
)

MAGIC = ord("D")
VERSION = 1
HEADER_BYTES = 16
INT_CODECS = tuple(f"int{b}" for b in range(2, 9))
VALUE_CODECS = sparse.VALUE_CODECS + INT_CODECS


def value_bits(codec: str) -> int:
    """b of an ``int<b>`` codec."""
    if codec not in INT_CODECS:
        raise LocalProtocolError(f"unknown integer value codec {codec!r}; expected one of {INT_CODECS}")
    return int(codec[3:])


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def check_value_codec(codec: str) -> None:
    if codec not in VALUE_CODECS:
        raise LocalProtocolError(f"unknown value codec {codec!r}; expected one of {VALUE_CODECS}")


# -- values ------------------------------------------------------------------------------------


def quantize_int(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[chunks, k]`` fp32 -> (codes ``[chunks, k]`` int64 in 0 … 2L, scales ``[chunks]`` fp32)."""
    levels = _levels(bits)
    scales = values.abs().amax(dim=1) / levels if values.numel() else values.new_zeros(values.shape[0])
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(values / safe[:, None]).clamp_(-levels, levels)
    return (q + levels).long(), scales


def dequantize_int(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes - _levels(bits)).to(torch.float32) * scales[:, None]


def quantized(chunks: sparse.SparseChunks, codec: str) -> sparse.SparseChunks:
    """``chunks`` with its values as every receiver of ``encode(chunks, codec)`` decodes them."""
    check_value_codec(codec)
    if codec in sparse.VALUE_CODECS:
        return sparse.quantized(chunks, codec)
    bits = value_bits(codec)
    values = dequantize_int(*quantize_int(chunks.values, bits), bits)
    return sparse.SparseChunks(chunk=chunks.chunk, k=chunks.k, indices=chunks.indices, values=values)


# -- sizes -------------------------------------------------------------------------------------


def encoded_size(*, chunk: int, k: int, chunks: int, codec: str) -> int:
    """Bytes of one encoded segment (the smallest index scheme for the layout)."""
    check_value_codec(codec)
    scheme = sparse.smallest_index_scheme(chunk, k)
    if codec in sparse.VALUE_CODECS:
        return sparse.encoded_size(chunk=chunk, k=k, chunks=chunks, value_codec=codec, scheme=scheme)
    values = -(-chunks * k * value_bits(codec) // 8)
    indices = -(-chunks * sparse.index_bits(scheme, chunk, k) // 8)
    return HEADER_BYTES + 4 * chunks + values + indices


# -- encode / decode ---------------------------------------------------------------------------


def encode(chunks: sparse.SparseChunks, *, codec: str) -> torch.Tensor:
    """One ``uint8`` tensor: ``sparse.encode``'s segment for its codecs, else header, scales,
    b-bit codes and indices."""
    check_value_codec(codec)
    if codec in sparse.VALUE_CODECS:
        return sparse.encode(chunks, value_codec=codec)
    sparse.check_layout(chunks.chunk, chunks.k)
    bits = value_bits(codec)
    scheme = sparse.smallest_index_scheme(chunks.chunk, chunks.k)
    header = torch.tensor(
        [MAGIC, VERSION, bits, sparse.INDEX_SCHEMES.index(scheme)], dtype=torch.uint8
    )
    dims = torch.tensor([chunks.chunk, chunks.k, chunks.chunks], dtype=torch.int32).view(torch.uint8)
    codes, scales = quantize_int(chunks.values, bits)
    return torch.cat([
        header,
        dims,
        scales.to(torch.float32).contiguous().view(torch.uint8),
        _pack_fixed(codes.reshape(-1), bits),
        _encode_indices(chunks, scheme),
    ])


def decode(
    payload: torch.Tensor, *, codec: str, chunk: int, k: int, chunks: int, peer_id: str | None = None
) -> sparse.SparseChunks:
    """Check ``payload`` against the expected codec and layout and rebuild its entries."""
    check_value_codec(codec)
    if codec in sparse.VALUE_CODECS:
        entries = sparse.decode(payload, chunk=chunk, k=k, chunks=chunks, peer_id=peer_id)
        if int(payload[2]) != sparse.VALUE_CODECS.index(codec):
            raise RemoteProtocolError(f"invalid DeMo payload: value codec is not {codec}", peer_id=peer_id)
        return entries

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"invalid DeMo payload: {why}", peer_id=peer_id)

    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < HEADER_BYTES:
        raise bad("expected a flat uint8 tensor with a header")
    bits = value_bits(codec)
    head = payload[:HEADER_BYTES].clone()
    magic, version, got_bits, scheme_id = (int(b) for b in head[:4])
    if magic != MAGIC or version != VERSION:
        raise bad("not an integer-valued DeMo segment of a known version")
    if got_bits != bits:
        raise bad(f"{got_bits}-bit values, expected {codec}")
    got = tuple(int(v) for v in head[4:16].view(torch.int32))
    if got != (chunk, k, chunks):
        raise bad(f"layout (chunk, k, chunks) {got}, expected {(chunk, k, chunks)}")
    scheme = sparse.smallest_index_scheme(chunk, k)
    if scheme_id >= len(sparse.INDEX_SCHEMES) or sparse.INDEX_SCHEMES[scheme_id] != scheme:
        raise bad(f"index scheme {scheme_id}, expected {scheme}")
    size = encoded_size(chunk=chunk, k=k, chunks=chunks, codec=codec)
    if payload.numel() != size:
        raise bad(f"{payload.numel()} bytes, its header implies {size}")
    at = HEADER_BYTES
    scales = payload[at : at + 4 * chunks].clone().view(torch.float32)
    at += 4 * chunks
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise bad("scale not finite or negative")
    nbytes = -(-chunks * k * bits // 8)
    codes = _unpack_fixed(payload[at : at + nbytes], chunks * k, bits).view(chunks, k)
    if codes.numel() and int(codes.max()) > 2 * _levels(bits):
        raise bad(f"value code above {2 * _levels(bits)}")
    values = dequantize_int(codes, scales, bits)
    if not bool(torch.isfinite(values).all()):
        raise bad("value not finite")
    indices = _decode_indices(payload[at + nbytes :], scheme, chunk=chunk, k=k, chunks=chunks, bad=bad)
    return sparse.SparseChunks(chunk=chunk, k=k, indices=indices, values=values)
