"""Sparse chunk codec: the top-k entries of every chunk, their values and compact indices.

Sans-IO and pickle-free, like ``codecs.py``. A flat fp32 vector is cut into chunks of ``chunk``
elements (the last one padded with zeros); from each chunk the ``k`` entries of largest
magnitude are kept (``top_k_per_chunk``). One encoded segment is a single ``uint8`` tensor:

====================  ======================================================================
bytes                 content
====================  ======================================================================
16                    header: version, index scheme, value codec, the Rice parameter b
                      (``rice`` only, else 0), then chunk, k and the number of chunks as
                      little-endian uint32
2 per chunk           the chunk's bf16 scale (``2bit`` only)
values                ``2bit``: 2 bits per kept value, four to a byte (sign, and magnitude
                      s or 3s with s = absmax / 3 of the chunk's kept values);
                      ``fp16`` / ``fp32``: the values themselves
indices               in the scheme named by the header (below), bits packed LSB first
====================  ======================================================================

Index schemes (``index_bits`` gives the size of the three fixed-size ones;
``smallest_index_scheme`` picks the smallest of those, so the choice follows the density;
``smallest_scheme_for`` measures all four on the entries at hand):

- ``offsets``: every index as a fixed-width number of ceil(log2 chunk) bits;
- ``bitmap``: one bit per element of the chunk;
- ``elias_fano``: the sorted offsets as deltas in Elias–Fano form — the low l = floor(log2
  (chunk / k)) bits of each offset, then the high parts as a unary bitmap of k + (chunk-1 >> l)
  + 1 bits. At chunk 4096 and k 64 (1.6 %): 8 bits per index against 12 (offsets) and 64
  (bitmap);
- ``rice``: the gaps between sorted offsets (g = offset − previous − 1, the first from −1) in
  Golomb–Rice form with one parameter b for the payload — all low b-bit parts first, then the
  quotients g >> b in unary (q zeros and a one each). Its size depends on the entries: at
  chunk 4096 and k 57, about 7.7 bits per index against Elias–Fano's 8.1, because the floor
  of each gap's quotient drops what Elias–Fano's fixed upper bitmap still spends.

Within a chunk the indices travel sorted ascending and the values follow that order, so all
three schemes describe the same entries. ``decode`` checks everything it reads against the
layout the receiver expects (a peer with another model, a lying header, indices out of range or
repeated, a non-finite scale or value): any inconsistency is a ``RemoteProtocolError``.
Receivers sum decoded contributions in fp32 (``add_into``); ``quantized`` returns what every
receiver will decode, so a sender can keep the residual exactly (error feedback).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lattica.errors import LocalProtocolError, RemoteProtocolError

VERSION = 2
HEADER_BYTES = 16
INDEX_SCHEMES = ("offsets", "bitmap", "elias_fano", "rice")
FIXED_INDEX_SCHEMES = INDEX_SCHEMES[:3]  # the size follows from the layout alone
VALUE_CODECS = ("2bit", "fp16", "fp32")
_VALUE_BITS = {"2bit": 2, "fp16": 16, "fp32": 32}
_MAX_CHUNK = 1 << 24
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclass(frozen=True, kw_only=True)
class SparseChunks:
    """``k`` entries of each of ``chunks`` chunks: ``indices`` (int64, sorted ascending within
    each row, each < ``chunk``) and their ``values`` (fp32), both of shape ``[chunks, k]``."""

    chunk: int
    k: int
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def chunks(self) -> int:
        return self.indices.shape[0]


def check_layout(chunk: int, k: int) -> None:
    if not 1 <= chunk <= _MAX_CHUNK:
        raise LocalProtocolError(f"chunk must be in [1, {_MAX_CHUNK}], got {chunk}")
    if not 1 <= k <= chunk:
        raise LocalProtocolError(f"k must be in [1, chunk={chunk}], got {k}")


def chunk_count(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def top_k_per_chunk(flat: torch.Tensor, *, chunk: int, k: int) -> SparseChunks:
    """The ``k`` largest-magnitude entries of every chunk of ``flat`` (zero-padded at the end).

    Ties go to the lower index (a stable sort on magnitude), so the choice is deterministic.
    """
    check_layout(chunk, k)
    x = flat.detach().reshape(-1).to(torch.float32)
    n = chunk_count(x.numel(), chunk)
    padded = torch.zeros(n * chunk, dtype=torch.float32)
    padded[: x.numel()] = x
    rows = padded.view(n, chunk)
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    indices = torch.sort(order, dim=1).values
    return SparseChunks(chunk=chunk, k=k, indices=indices, values=torch.gather(rows, 1, indices))


def densify(sparse: SparseChunks, numel: int) -> torch.Tensor:
    """The flat fp32 vector of ``numel`` elements holding ``sparse``'s entries, zeros elsewhere."""
    out = torch.zeros(sparse.chunks * sparse.chunk, dtype=torch.float32)
    add_into(out, sparse)
    return out[:numel]


def add_into(total: torch.Tensor, sparse: SparseChunks) -> None:
    """``total`` (flat fp32, at least chunks × chunk elements) += the entries, in place."""
    rows = total[: sparse.chunks * sparse.chunk].view(sparse.chunks, sparse.chunk)
    rows.scatter_add_(1, sparse.indices, sparse.values)


# -- values ------------------------------------------------------------------------------------


BF16_LEAST = 2.0**-133  # bf16's least positive (subnormal) value


def quantize_2bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[chunks, k]`` fp32 values -> (codes ``[chunks, k]`` uint8 in 0..3, scales ``[chunks]``).

    s = absmax / 3 per row, rounded to bf16 (the wire's 2 bytes; returned as fp32); bit 0 of a
    code is the sign, bit 1 chooses magnitude 3s over s (threshold 2s). So the row's absmax
    decodes to within 2^-8 of itself, signs are kept, and every value is off by at most s. A
    row of zeros has scale 0 and decodes to zeros; any other row's s is at least bf16's least
    positive value (``BF16_LEAST``), so a row of tiny values (absmax / 3 under it) does not
    decode to zeros, signs lost.
    """
    absmax = values.abs().amax(dim=1) if values.numel() else values.new_zeros(values.shape[0])
    scales = torch.where(absmax == 0, 0.0, (absmax / 3).clamp_min(BF16_LEAST))  # NaN stays NaN
    scales = scales.to(torch.bfloat16).to(torch.float32)
    big = values.abs() >= 2 * scales[:, None]
    codes = (values < 0).to(torch.uint8) | (big.to(torch.uint8) << 1)
    return codes, scales


def dequantize_2bit(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    magnitude = 1.0 + 2.0 * (codes >> 1).to(torch.float32)
    signed = torch.where(codes & 1 > 0, -magnitude, magnitude)
    return signed * scales[:, None]


def quantized(sparse: SparseChunks, value_codec: str) -> SparseChunks:
    """``sparse`` with its values as every receiver of ``encode(sparse, value_codec)`` decodes them."""
    _check_value_codec(value_codec)
    if value_codec == "2bit":
        values = dequantize_2bit(*quantize_2bit(sparse.values))
    elif value_codec == "fp16":
        values = sparse.values.to(torch.float16).to(torch.float32)
    else:
        values = sparse.values
    return SparseChunks(chunk=sparse.chunk, k=sparse.k, indices=sparse.indices, values=values)


# -- sizes -------------------------------------------------------------------------------------


def _offset_width(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def _ef_low_bits(chunk: int, k: int) -> int:
    return max(0, math.floor(math.log2(chunk / k)))


def _ef_upper_bits(chunk: int, k: int) -> int:
    return k + ((chunk - 1) >> _ef_low_bits(chunk, k)) + 1


def index_bits(scheme: str, chunk: int, k: int) -> int:
    """Bits one chunk's ``k`` indices take in a fixed-size ``scheme``."""
    if scheme == "offsets":
        return k * _offset_width(chunk)
    if scheme == "bitmap":
        return chunk
    if scheme == "elias_fano":
        return k * _ef_low_bits(chunk, k) + _ef_upper_bits(chunk, k)
    if scheme == "rice":
        raise LocalProtocolError("the size of rice indices depends on the entries: use rice_bits")
    raise LocalProtocolError(f"unknown index scheme {scheme!r}; expected one of {INDEX_SCHEMES}")


def smallest_index_scheme(chunk: int, k: int) -> str:
    """The fixed-size scheme with the fewest bits at this density (the first listed on a tie)."""
    return min(FIXED_INDEX_SCHEMES, key=lambda s: index_bits(s, chunk, k))


def _gaps(indices: torch.Tensor) -> torch.Tensor:
    """Sorted offsets ``[chunks, k]`` -> gaps g = offset − previous − 1 (the first from −1)."""
    previous = torch.cat([indices.new_full((indices.shape[0], 1), -1), indices[:, :-1]], dim=1)
    return indices - previous - 1


def rice_parameter(sparse: SparseChunks) -> int:
    """The b in [0, ceil(log2 chunk)] that makes ``sparse``'s rice indices smallest."""
    gaps = _gaps(sparse.indices)
    return min(range(_offset_width(sparse.chunk) + 1), key=lambda b: _rice_bits(gaps, b))


def _rice_bits(gaps: torch.Tensor, b: int) -> int:
    return gaps.numel() * (b + 1) + int((gaps >> b).sum())


def rice_bits(sparse: SparseChunks, b: int | None = None) -> int:
    """Bits all of ``sparse``'s indices take as rice (parameter ``b``; the best if None)."""
    b = rice_parameter(sparse) if b is None else b
    return _rice_bits(_gaps(sparse.indices), b)


def smallest_scheme_for(sparse: SparseChunks) -> str:
    """The scheme that encodes these entries in the fewest bytes, rice included (measured);
    a fixed-size scheme on a tie."""
    fixed = smallest_index_scheme(sparse.chunk, sparse.k)
    fixed_bytes = -(-sparse.chunks * index_bits(fixed, sparse.chunk, sparse.k) // 8)
    return "rice" if -(-rice_bits(sparse) // 8) < fixed_bytes else fixed


def _fixed_part_size(*, k: int, chunks: int, value_codec: str) -> int:
    """Header, scales and values: everything before the indices."""
    _check_value_codec(value_codec)
    scales = 2 * chunks if value_codec == "2bit" else 0
    return HEADER_BYTES + scales + -(-chunks * k * _VALUE_BITS[value_codec] // 8)


def encoded_size(*, chunk: int, k: int, chunks: int, value_codec: str, scheme: str) -> int:
    """Bytes of one encoded segment with a fixed-size index scheme: header, scales, values and
    indices (``len(encode(...))`` gives a rice segment's)."""
    indices = -(-chunks * index_bits(scheme, chunk, k) // 8)
    return _fixed_part_size(k=k, chunks=chunks, value_codec=value_codec) + indices


def rice_size_bounds(*, chunk: int, k: int, chunks: int, value_codec: str, b: int) -> tuple[int, int]:
    """The fewest and the most bytes a rice segment of this layout can take: every gap's
    quotient is 0 at best, and a chunk's quotients add up to at most (chunk − k) >> b."""
    fixed = _fixed_part_size(k=k, chunks=chunks, value_codec=value_codec)
    least = chunks * k * (b + 1)
    return fixed + -(-least // 8), fixed + -(-(least + chunks * ((chunk - k) >> b)) // 8)


# -- encode / decode ---------------------------------------------------------------------------


def encode(sparse: SparseChunks, *, value_codec: str, scheme: str | None = None) -> torch.Tensor:
    """One ``uint8`` tensor: header, scales, values, indices (``scheme``: the smallest
    fixed-size one if None; ``smallest_scheme_for`` measures rice too)."""
    _check_value_codec(value_codec)
    check_layout(sparse.chunk, sparse.k)
    scheme = scheme or smallest_index_scheme(sparse.chunk, sparse.k)
    if scheme not in INDEX_SCHEMES:
        raise LocalProtocolError(f"unknown index scheme {scheme!r}; expected one of {INDEX_SCHEMES}")
    b = rice_parameter(sparse) if scheme == "rice" else 0
    header = torch.tensor(
        [VERSION, INDEX_SCHEMES.index(scheme), VALUE_CODECS.index(value_codec), b], dtype=torch.uint8
    )
    dims = torch.tensor([sparse.chunk, sparse.k, sparse.chunks], dtype=torch.int32).view(torch.uint8)
    parts = [header, dims]
    if value_codec == "2bit":
        codes, scales = quantize_2bit(sparse.values)
        parts += [scales.to(torch.bfloat16).contiguous().view(torch.uint8), _pack_fixed(codes.reshape(-1).long(), 2)]
    else:
        dtype = torch.float16 if value_codec == "fp16" else torch.float32
        parts.append(sparse.values.reshape(-1).to(dtype).contiguous().view(torch.uint8))
    parts.append(_encode_rice(sparse, b) if scheme == "rice" else _encode_indices(sparse, scheme))
    return torch.cat(parts)


def decode(
    payload: torch.Tensor, *, chunk: int, k: int, chunks: int, peer_id: str | None = None
) -> SparseChunks:
    """Check ``payload`` against the expected layout and rebuild its entries."""

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"invalid sparse payload: {why}", peer_id=peer_id)

    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < HEADER_BYTES:
        raise bad("expected a flat uint8 tensor with a header")
    head = payload[:HEADER_BYTES].clone()
    version, scheme_id, codec_id, b = (int(v) for v in head[:4])
    if version != VERSION or scheme_id >= len(INDEX_SCHEMES) or codec_id >= len(VALUE_CODECS):
        raise bad("unknown version, index scheme or value codec")
    got = tuple(int(v) for v in head[4:16].view(torch.int32))
    if got != (chunk, k, chunks):
        raise bad(f"layout (chunk, k, chunks) {got}, expected {(chunk, k, chunks)}")
    scheme, value_codec = INDEX_SCHEMES[scheme_id], VALUE_CODECS[codec_id]
    if scheme == "rice":
        if b > _offset_width(chunk):
            raise bad(f"rice parameter {b} above {_offset_width(chunk)}")
        least, most = rice_size_bounds(chunk=chunk, k=k, chunks=chunks, value_codec=value_codec, b=b)
        if not least <= payload.numel() <= most:
            raise bad(f"{payload.numel()} bytes, its header allows {least} to {most}")
    else:
        if b != 0:
            raise bad("rice parameter set for a fixed-size index scheme")
        size = encoded_size(chunk=chunk, k=k, chunks=chunks, value_codec=value_codec, scheme=scheme)
        if payload.numel() != size:
            raise bad(f"{payload.numel()} bytes, its header implies {size}")
    at = HEADER_BYTES
    if value_codec == "2bit":
        scales = payload[at : at + 2 * chunks].clone().view(torch.bfloat16).to(torch.float32)
        at += 2 * chunks
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise bad("scale not finite or negative")
        nbytes = -(-chunks * k * 2 // 8)
        codes = _unpack_fixed(payload[at : at + nbytes], chunks * k, 2).to(torch.uint8)
        values = dequantize_2bit(codes.view(chunks, k), scales)
    else:
        dtype = torch.float16 if value_codec == "fp16" else torch.float32
        nbytes = chunks * k * dtype.itemsize
        values = payload[at : at + nbytes].clone().view(dtype).to(torch.float32).view(chunks, k)
        if not bool(torch.isfinite(values).all()):
            raise bad("value not finite")
    at += nbytes
    if scheme == "rice":
        indices = _decode_rice(payload[at:], b, chunk=chunk, k=k, chunks=chunks, bad=bad)
    else:
        indices = _decode_indices(payload[at:], scheme, chunk=chunk, k=k, chunks=chunks, bad=bad)
    return SparseChunks(chunk=chunk, k=k, indices=indices, values=values)


def _encode_rice(sparse: SparseChunks, b: int) -> torch.Tensor:
    """All gaps' low b bits (row-major), then each gap's quotient in unary: q zeros, a one."""
    gaps = _gaps(sparse.indices).reshape(-1)
    low = _fixed_bits(gaps & ((1 << b) - 1), b).reshape(-1)
    ends = torch.cumsum((gaps >> b) + 1, dim=0) - 1  # where each quotient's one goes
    unary = torch.zeros(int(ends[-1]) + 1 if ends.numel() else 0, dtype=torch.bool)
    unary[ends] = True
    return _pack_bits(torch.cat([low, unary]))


def _decode_rice(
    raw: torch.Tensor,
    b: int,
    *,
    chunk: int,
    k: int,
    chunks: int,
    bad: Callable[[str], RemoteProtocolError],
) -> torch.Tensor:
    count = chunks * k
    low_bits = count * b
    if raw.numel() * 8 < low_bits + count:
        raise bad("rice indices shorter than their layout")
    bits = _unpack_bits(raw, raw.numel() * 8)
    low = _from_bits(bits[:low_bits].view(count, b)) if b else torch.zeros(count, dtype=torch.long)
    ends = bits[low_bits:].nonzero().view(-1)
    if ends.numel() != count:
        raise bad(f"rice indices with {ends.numel()} quotients, expected {count}")
    if count and (low_bits + int(ends[-1]) + 8) // 8 != raw.numel():  # only the last byte pads
        raise bad("rice indices followed by extra bytes")
    quotients = torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1
    if count and int(quotients.max()) > (chunk - 1) >> b:  # a gap of chunk or more
        raise bad("index outside its chunk")
    gaps = ((quotients << b) | low).view(chunks, k)
    idx = torch.cumsum(gaps + 1, dim=1) - 1  # strictly increasing by construction
    if idx.numel() and bool((idx[:, -1] >= chunk).any()):
        raise bad("index outside its chunk")
    return idx


def _check_value_codec(value_codec: str) -> None:
    if value_codec not in VALUE_CODECS:
        raise LocalProtocolError(f"unknown value codec {value_codec!r}; expected one of {VALUE_CODECS}")


def _encode_indices(sparse: SparseChunks, scheme: str) -> torch.Tensor:
    chunk, k, idx = sparse.chunk, sparse.k, sparse.indices
    if scheme == "offsets":
        return _pack_fixed(idx.reshape(-1), _offset_width(chunk))
    if scheme == "bitmap":
        bits = torch.zeros(sparse.chunks, chunk, dtype=torch.bool)
        bits.scatter_(1, idx, True)
        return _pack_bits(bits.reshape(-1))
    low_bits, upper = _ef_low_bits(chunk, k), _ef_upper_bits(chunk, k)
    low = _fixed_bits(idx & ((1 << low_bits) - 1), low_bits).reshape(-1)
    ones = (idx >> low_bits) + torch.arange(k)  # strictly increasing: distinct bit positions
    high = torch.zeros(sparse.chunks, upper, dtype=torch.bool)
    high.scatter_(1, ones, True)
    return _pack_bits(torch.cat([low, high.reshape(-1)]))


def _decode_indices(
    raw: torch.Tensor,
    scheme: str,
    *,
    chunk: int,
    k: int,
    chunks: int,
    bad: Callable[[str], RemoteProtocolError],
) -> torch.Tensor:
    if scheme == "offsets":
        idx = _unpack_fixed(raw, chunks * k, _offset_width(chunk)).view(chunks, k)
    elif scheme == "bitmap":
        bits = _unpack_bits(raw, chunks * chunk).view(chunks, chunk)
        if not bool((bits.sum(dim=1) == k).all()):
            raise bad("bitmap chunk without exactly k entries")
        idx = bits.nonzero()[:, 1].view(chunks, k)
    else:
        low_bits, upper = _ef_low_bits(chunk, k), _ef_upper_bits(chunk, k)
        bits = _unpack_bits(raw, chunks * (k * low_bits + upper))
        low = _from_bits(bits[: chunks * k * low_bits].view(chunks * k, low_bits)).view(chunks, k)
        high = bits[chunks * k * low_bits :].view(chunks, upper)
        if not bool((high.sum(dim=1) == k).all()):
            raise bad("Elias-Fano chunk without exactly k entries")
        positions = high.nonzero()[:, 1].view(chunks, k)
        idx = ((positions - torch.arange(k)) << low_bits) | low
    if chunks and k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
        raise bad("indices not strictly increasing within a chunk")
    if idx.numel() and (bool((idx < 0).any()) or bool((idx >= chunk).any())):
        raise bad("index outside its chunk")
    return idx


def _fixed_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[n]`` non-negative ints -> ``[n, width]`` bools, least significant bit first."""
    return ((values.reshape(-1, 1) >> torch.arange(width)) & 1).bool()


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return (bits.long() << torch.arange(bits.shape[1])).sum(dim=1)


def _pack_fixed(values: torch.Tensor, width: int) -> torch.Tensor:
    return _pack_bits(_fixed_bits(values, width).reshape(-1))


def _unpack_fixed(raw: torch.Tensor, count: int, width: int) -> torch.Tensor:
    return _from_bits(_unpack_bits(raw, count * width).view(count, width))


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    if raw.numel() * 8 < count:
        raise RemoteProtocolError("sparse payload shorter than its layout")
    bits = (raw.reshape(-1, 1) & _BIT_WEIGHTS) > 0
    return bits.reshape(-1)[:count]
