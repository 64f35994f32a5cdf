"""Rice-coded sparse indices and bf16 2-bit scales: hand-computed bytes, round trips, sizes at
SparseLoCo's densities, and hostile payloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lattica.errors import RemoteProtocolError
from lattica.numerics import sparse


def _entries(indices: list[list[int]], chunk: int) -> sparse.SparseChunks:
    idx = torch.tensor(indices)
    return sparse.SparseChunks(
        chunk=chunk, k=idx.shape[1], indices=idx, values=torch.arange(1, idx.numel() + 1.0).view(idx.shape)
    )


def test_rice_hand_computed_bits():
    # offsets 2, 3, 12 of a chunk of 16 -> gaps 2, 0, 8. b = 1 and b = 2 both take 11 bits
    # (b = 0: 13, b = 3: 13); the smaller b wins the tie. b = 1: low bits 0, 0, 0, quotients
    # 1, 0, 4 in unary (zeros then a one): 0 1 | 1 | 0 0 0 0 1. LSB first: bits 4, 5 and 10
    # set -> bytes 48, 4.
    s = _entries([[2, 3, 12]], 16)
    assert sparse.rice_parameter(s) == 1
    assert sparse.rice_bits(s) == 11
    assert sparse.rice_bits(s, 0) == 13
    payload = sparse.encode(s, value_codec="fp32", scheme="rice")
    assert payload[:4].tolist() == [sparse.VERSION, sparse.INDEX_SCHEMES.index("rice"), 2, 1]
    assert payload.numel() == 16 + 3 * 4 + 2
    assert payload[-2:].tolist() == [48, 4]
    got = sparse.decode(payload, chunk=16, k=3, chunks=1)
    assert got.indices.tolist() == [[2, 3, 12]]
    assert got.values.tolist() == [[1.0, 2.0, 3.0]]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 3000),
    st.integers(1, 600),
    st.floats(0.001, 1.0),
    st.sampled_from(sparse.VALUE_CODECS),
    st.integers(0, 2**31 - 1),
)
def test_rice_round_trip_and_size(numel, chunk, density, value_codec, seed):
    k = max(1, min(chunk, round(density * chunk)))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    s = sparse.top_k_per_chunk(x, chunk=chunk, k=k)
    payload = sparse.encode(s, value_codec=value_codec, scheme="rice")
    b = int(payload[3])
    least, most = sparse.rice_size_bounds(chunk=chunk, k=k, chunks=s.chunks, value_codec=value_codec, b=b)
    assert least <= payload.numel() <= most
    fixed = sparse.encoded_size(chunk=chunk, k=k, chunks=s.chunks, value_codec=value_codec, scheme="offsets")
    fixed -= -(-s.chunks * sparse.index_bits("offsets", chunk, k) // 8)  # header, scales, values
    assert payload.numel() == fixed + -(-sparse.rice_bits(s) // 8)
    got = sparse.decode(payload, chunk=chunk, k=k, chunks=s.chunks)
    assert torch.equal(got.indices, s.indices)
    assert torch.equal(got.values, sparse.quantized(s, value_codec).values)


@pytest.mark.parametrize(("k", "most_bits_per_index"), [(41, 8.3), (57, 7.9), (82, 7.4), (123, 6.8)])
def test_rice_beats_elias_fano_at_sparselocos_densities(k, most_bits_per_index):
    # 1 %, 1.4 %, 2 %, 3 % of a 4096 chunk, the tiny model's 31 chunks of random entries
    s = sparse.top_k_per_chunk(torch.randn(124_672, generator=torch.Generator().manual_seed(k)), chunk=4096, k=k)
    rice = sparse.rice_bits(s) / s.indices.numel()
    elias_fano = sparse.index_bits("elias_fano", 4096, k) / k
    assert rice < elias_fano
    assert rice <= most_bits_per_index
    assert sparse.smallest_scheme_for(s) == "rice"
    assert sparse.encode(s, value_codec="2bit", scheme="rice").numel() < sparse.encode(
        s, value_codec="2bit", scheme="elias_fano"
    ).numel()


def test_a_dense_chunk_picks_a_fixed_scheme():
    s = _entries([list(range(0, 64, 2))], 64)  # half a chunk, every gap 1: rice ties a bitmap (64 bits)
    assert sparse.smallest_scheme_for(s) == "bitmap"


def test_bf16_scale_on_the_wire_decodes_to_what_the_sender_kept():
    values = torch.tensor([[0.3, -0.1, 0.05]])
    _codes, scales = sparse.quantize_2bit(values)
    assert scales.tolist() == [torch.tensor(0.1).to(torch.bfloat16).item()]
    s = sparse.SparseChunks(chunk=8, k=3, indices=torch.tensor([[0, 3, 7]]), values=values)
    payload = sparse.encode(s, value_codec="2bit", scheme="rice")
    got = sparse.decode(payload, chunk=8, k=3, chunks=1)
    assert torch.equal(got.values, sparse.quantized(s, "2bit").values)
    assert float(got.values[0, 0]) == pytest.approx(0.3, rel=2**-8)  # the absmax, to bf16


def _rice_payload() -> tuple[torch.Tensor, sparse.SparseChunks]:
    s = sparse.top_k_per_chunk(torch.randn(300, generator=torch.Generator().manual_seed(3)), chunk=64, k=5)
    return sparse.encode(s, value_codec="2bit", scheme="rice"), s


def _with(p: torch.Tensor, i: int, v: int) -> torch.Tensor:
    p[i] = v
    return p


def _with_bit(p: torch.Tensor, bit: int) -> torch.Tensor:
    p[bit // 8] |= 1 << (bit % 8)
    return p


def _first_unary_bit(p: torch.Tensor, s: sparse.SparseChunks) -> int:
    at = 16 + 2 * s.chunks + -(-s.chunks * s.k * 2 // 8)
    return at * 8 + s.chunks * s.k * int(p[3])


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda p, s: p[:-1], "quotients|bytes"),  # truncated
        (lambda p, s: p[:40], "bytes"),  # cut far below the least a layout takes
        (lambda p, s: torch.cat([p, torch.zeros(1, dtype=torch.uint8)]), "extra bytes|bytes"),
        (lambda p, s: torch.cat([p, torch.full((500,), 255, dtype=torch.uint8)]), "bytes"),  # too long
        (lambda p, s: _with(p, 3, 7), "rice parameter"),  # b above log2(64)
        (lambda p, s: _with(p, 1, sparse.INDEX_SCHEMES.index("elias_fano")), "rice parameter"),
        (lambda p, s: _with_bit(p, _first_unary_bit(p, s)), "quotients"),  # one quotient too many
        (lambda p, s: _with(p, len(p) - 1, 0), "quotients"),  # the last quotient's one removed
        (lambda p, s: _set_scale(p, float("inf")), "scale"),
    ],
)
def test_hostile_rice_payloads_are_remote_protocol_errors(mutate, why):
    payload, s = _rice_payload()
    with pytest.raises(RemoteProtocolError, match=why) as info:
        sparse.decode(mutate(payload.clone(), s), chunk=64, k=5, chunks=s.chunks, peer_id="peer-x")
    assert info.value.peer_id == "peer-x"


def _forge(*, chunk: int, k: int, b: int, gaps: list[int]) -> torch.Tensor:
    """A rice segment with fp32 values written by hand from ``gaps`` (one row per k gaps)."""
    chunks = len(gaps) // k
    head = torch.tensor([sparse.VERSION, sparse.INDEX_SCHEMES.index("rice"), 2, b], dtype=torch.uint8)
    dims = torch.tensor([chunk, k, chunks], dtype=torch.int32).view(torch.uint8)
    values = torch.ones(chunks * k, dtype=torch.float32).view(torch.uint8)
    bits = [(g >> i) & 1 for g in gaps for i in range(b)]
    for g in gaps:
        bits += [0] * (g >> b) + [1]
    bits += [0] * (-len(bits) % 8)
    raw = [sum(bits[j + i] << i for i in range(8)) for j in range(0, len(bits), 8)]
    return torch.cat([head, dims, values, torch.tensor(raw, dtype=torch.uint8)])


def test_forged_streams_decode_only_when_every_offset_is_inside_its_chunk():
    ok = sparse.decode(_forge(chunk=16, k=2, b=1, gaps=[3, 4, 0, 14]), chunk=16, k=2, chunks=2)
    assert ok.indices.tolist() == [[3, 8], [0, 15]]
    # one quotient of 20 (within the payload's size bound: the other chunk's gap is 0)
    with pytest.raises(RemoteProtocolError, match="outside"):
        sparse.decode(_forge(chunk=16, k=1, b=0, gaps=[20, 0]), chunk=16, k=1, chunks=2)
    # each gap below the chunk, their sum past it: offsets 10 and 21
    with pytest.raises(RemoteProtocolError, match="outside"):
        sparse.decode(_forge(chunk=16, k=2, b=0, gaps=[10, 10, 0, 0]), chunk=16, k=2, chunks=2)


def _set_scale(p: torch.Tensor, v: float) -> torch.Tensor:
    p[16:18] = torch.tensor([v], dtype=torch.bfloat16).view(torch.uint8)
    return p
