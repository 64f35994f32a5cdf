"""Sparse chunk codec: top-k per chunk, 2-bit bounds, index schemes, hostile payloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lattica.errors import RemoteProtocolError
from lattica.numerics import sparse


def test_top_k_per_chunk_matches_hand_computed_choice():
    x = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -0.5, 0.2, 1.0, 7.0])  # chunks of 4, last padded
    s = sparse.top_k_per_chunk(x, chunk=4, k=2)
    assert s.indices.tolist() == [[1, 2], [0, 3], [0, 1]]
    assert s.values.tolist() == [[-5.0, 2.0], [3.0, 1.0], [7.0, 0.0]]


def test_top_k_ties_go_to_the_lower_index():
    s = sparse.top_k_per_chunk(torch.tensor([1.0, -1.0, 1.0, 1.0]), chunk=4, k=2)
    assert s.indices.tolist() == [[0, 1]]


def test_densify_puts_entries_back_and_zeros_elsewhere():
    x = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -0.5, 0.2, 1.0, 7.0])
    dense = sparse.densify(sparse.top_k_per_chunk(x, chunk=4, k=2), x.numel())
    assert dense.tolist() == [0.0, -5.0, 2.0, 0.0, 3.0, 0.0, 0.0, 1.0, 7.0]


def test_2bit_hand_computed_codes():
    # absmax 6 -> s = 2: |v| >= 4 decodes to 3s = 6, below to s = 2; signs kept
    values = torch.tensor([[6.0, -4.5, 3.9, -0.1]])
    codes, scales = sparse.quantize_2bit(values)
    assert scales.tolist() == [2.0]
    assert sparse.dequantize_2bit(codes, scales).tolist() == [[6.0, -6.0, 2.0, -2.0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40))
@example([1.401298464324817e-45])  # absmax / 3 under bf16's least value: the scale must not round to 0
def test_2bit_round_trip_error_is_at_most_the_scale(xs):
    values = torch.tensor([xs])
    codes, scales = sparse.quantize_2bit(values)
    decoded = sparse.dequantize_2bit(codes, scales)
    s = float(scales[0])
    assert s == pytest.approx(values.abs().max().item() / 3, rel=2**-8)  # bf16 on the wire
    assert float((decoded - values).abs().max()) <= s * (1 + 1e-6) + 1e-30
    assert bool(((decoded > 0) == (values > 0))[values != 0].all())  # signs kept


def test_index_sizes_and_the_smallest_scheme_at_sparse_densities():
    # chunk 4096, k 64 (1.6 %): 12 bits per offset, a 4096-bit map, Elias-Fano l = 6:
    # 64 * 6 low bits + 64 + (4095 >> 6) + 1 upper bits
    assert sparse.index_bits("offsets", 4096, 64) == 768
    assert sparse.index_bits("bitmap", 4096, 64) == 4096
    assert sparse.index_bits("elias_fano", 4096, 64) == 64 * 6 + 64 + 64
    for k in (41, 64, 82, 123):  # 1 %, 1.6 %, 2 %, 3 %
        assert sparse.smallest_index_scheme(4096, k) == "elias_fano"
    assert sparse.smallest_index_scheme(64, 32) == "bitmap"  # half of a chunk: a map is smallest
    assert sparse.smallest_index_scheme(4096, 1) == "offsets"


@pytest.mark.parametrize("scheme", sparse.FIXED_INDEX_SCHEMES)
@pytest.mark.parametrize("value_codec", sparse.VALUE_CODECS)
@pytest.mark.parametrize(("numel", "chunk", "k"), [(10_000, 4096, 64), (300, 64, 32), (5, 7, 7), (9, 4, 1)])
def test_round_trip_through_every_scheme_and_codec(scheme, value_codec, numel, chunk, k):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    s = sparse.top_k_per_chunk(x, chunk=chunk, k=k)
    payload = sparse.encode(s, value_codec=value_codec, scheme=scheme)
    assert payload.dtype == torch.uint8
    assert payload.numel() == sparse.encoded_size(
        chunk=chunk, k=k, chunks=s.chunks, value_codec=value_codec, scheme=scheme
    )
    got = sparse.decode(payload, chunk=chunk, k=k, chunks=s.chunks)
    expected = sparse.quantized(s, value_codec)
    assert torch.equal(got.indices, s.indices)
    assert torch.equal(got.values, expected.values)


def test_encoded_size_counts_header_scales_values_and_indices():
    # 31 chunks (the tiny model: 124,672 values), k 64, 2-bit values, Elias-Fano indices
    size = sparse.encoded_size(chunk=4096, k=64, chunks=31, value_codec="2bit", scheme="elias_fano")
    assert size == 16 + 31 * 2 + 31 * 64 * 2 // 8 + 31 * 64  # bf16 scales


def _payload() -> tuple[torch.Tensor, sparse.SparseChunks]:
    s = sparse.top_k_per_chunk(torch.randn(200, generator=torch.Generator().manual_seed(1)), chunk=64, k=4)
    return sparse.encode(s, value_codec="2bit", scheme="elias_fano"), s


def test_a_payload_for_another_layout_is_refused():
    payload, s = _payload()
    with pytest.raises(RemoteProtocolError, match="layout"):
        sparse.decode(payload, chunk=64, k=5, chunks=s.chunks, peer_id="p")


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda p: p[:-1], "bytes"),
        (lambda p: torch.cat([p, torch.zeros(1, dtype=torch.uint8)]), "bytes"),
        (lambda p: _set(p, 0, 9), "version"),
        (lambda p: _set(p, 1, 7), "version"),
        (lambda p: _set_scale(p, float("nan")), "scale"),
        (lambda p: _set_scale(p, -1.0), "scale"),
        (lambda p: _set(p, len(p) - 1, 0), "entries|increasing|outside"),
    ],
)
def test_hostile_payloads_are_remote_protocol_errors(mutate, why):
    payload, s = _payload()
    with pytest.raises(RemoteProtocolError, match=why) as info:
        sparse.decode(mutate(payload.clone()), chunk=64, k=4, chunks=s.chunks, peer_id="peer-x")
    assert info.value.peer_id == "peer-x"


def test_repeated_offsets_are_refused():
    s = sparse.SparseChunks(
        chunk=8, k=2, indices=torch.tensor([[3, 3]]), values=torch.tensor([[1.0, 1.0]])
    )
    payload = sparse.encode(s, value_codec="fp32", scheme="offsets")
    with pytest.raises(RemoteProtocolError, match="increasing"):
        sparse.decode(payload, chunk=8, k=2, chunks=1)


def _set(p: torch.Tensor, i: int, v: int) -> torch.Tensor:
    p[i] = v
    return p


def _set_scale(p: torch.Tensor, v: float) -> torch.Tensor:
    p[16:18] = torch.tensor([v], dtype=torch.bfloat16).view(torch.uint8)
    return p


def test_2bit_a_row_with_a_nan_keeps_a_nan_scale():
    """A non-finite row must not decode as a finite one: the receiver's decode check refuses it."""
    _, scales = sparse.quantize_2bit(torch.tensor([[1.0, float("nan")], [1e-45, 0.0], [0.0, 0.0]]))
    assert torch.isnan(scales[0])
    assert float(scales[1]) > 0
    assert float(scales[2]) == 0.0
