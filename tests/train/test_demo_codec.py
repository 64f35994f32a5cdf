"""DeMo's wire codec: integer values with a per-chunk scale, sizes, round trips, hostile payloads."""

from __future__ import annotations

import pytest
import torch

from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.numerics import demo_codec, sparse


def _chunks(chunks=3, chunk=64, k=8, seed=0):
    x = torch.randn(chunks * chunk, generator=torch.Generator().manual_seed(seed))
    return sparse.top_k_per_chunk(x, chunk=chunk, k=k)


def test_int4_hand_computed_codes_and_values():
    # absmax 7, L = 7: s = 1; round(v / s) = 7, -3, 0, 2; codes + 7
    codes, scales = demo_codec.quantize_int(torch.tensor([[7.0, -3.4, 0.2, 1.6]]), 4)
    assert codes.tolist() == [[14, 4, 7, 9]]
    assert scales.tolist() == [1.0]
    assert demo_codec.dequantize_int(codes, scales, 4).tolist() == [[7.0, -3.0, 0.0, 2.0]]
    # a row of zeros: scale 0, decodes to zeros
    codes, scales = demo_codec.quantize_int(torch.zeros(1, 3), 8)
    assert codes.tolist() == [[127, 127, 127]]
    assert demo_codec.dequantize_int(codes, scales, 8).tolist() == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("codec", demo_codec.INT_CODECS)
def test_round_trip_is_what_quantized_promises_within_half_a_step(codec):
    s = _chunks()
    bits = demo_codec.value_bits(codec)
    payload = demo_codec.encode(s, codec=codec)
    back = demo_codec.decode(payload, codec=codec, chunk=64, k=8, chunks=3, peer_id="p")
    assert torch.equal(back.indices, s.indices)
    assert torch.equal(back.values, demo_codec.quantized(s, codec).values)
    step = s.values.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert bool(((back.values - s.values).abs() <= step / 2 + 1e-6).all())
    # the largest entry of every chunk is exact (up to fp32 rounding of scale × L)
    big = s.values.abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(back.values.gather(1, big), s.values.gather(1, big), rtol=1e-6)


@pytest.mark.parametrize("codec", ["fp16", "fp32", "2bit"])
def test_sparse_codecs_travel_as_sparse_segments(codec):
    s = _chunks()
    payload = demo_codec.encode(s, codec=codec)
    assert torch.equal(payload, sparse.encode(s, value_codec=codec))
    back = demo_codec.decode(payload, codec=codec, chunk=64, k=8, chunks=3)
    assert torch.equal(back.values, demo_codec.quantized(s, codec).values)


def test_sizes_count_header_scales_values_and_indices():
    # 30 tiles of 4096, k 192, int8: Elias-Fano indices, l = floor(log2(4096/192)) = 4,
    # high part 192 + (4095 >> 4) + 1 = 448 bits: 1216 bits per tile
    expected = 16 + 4 * 30 + 30 * 192 + (30 * 1216) // 8
    assert demo_codec.encoded_size(chunk=4096, k=192, chunks=30, codec="int8") == expected == 10456
    s = _chunks(chunks=30, chunk=4096, k=192)
    assert demo_codec.encode(s, codec="int8").numel() == expected
    # int4: half the value bytes
    assert demo_codec.encode(s, codec="int4").numel() == expected - 30 * 192 // 2
    # against fp16 at the same k: 8 bits a value saved, 4 bytes a chunk of scale paid
    fp16 = demo_codec.encoded_size(chunk=4096, k=192, chunks=30, codec="fp16")
    assert fp16 - expected == 30 * 192 - 4 * 30


def test_unknown_codecs_are_local_errors():
    with pytest.raises(LocalProtocolError, match="codec"):
        demo_codec.encode(_chunks(), codec="int9")
    with pytest.raises(LocalProtocolError, match="codec"):
        demo_codec.value_bits("fp16")


def _set(payload: torch.Tensor, at: int, value: int) -> torch.Tensor:
    payload[at] = value
    return payload


def _set_scale(payload: torch.Tensor, value: float) -> torch.Tensor:
    payload[16:20] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
    return payload


def _code_15(payload: torch.Tensor) -> torch.Tensor:
    payload[16 + 4 * 3] |= 0x0F  # the first int4 code: 15 > 2L = 14
    return payload


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda p: p[:-1], "bytes"),
        (lambda p: torch.cat([p, torch.zeros(1, dtype=torch.uint8)]), "bytes"),
        (lambda p: p[:10], "header"),
        (lambda p: p.view(torch.int8), "uint8"),
        (lambda p: _set(p, 0, ord("X")), "version"),
        (lambda p: _set(p, 1, 2), "version"),
        (lambda p: _set(p, 2, 8), "8-bit values"),
        (lambda p: _set(p, 3, 0), "index scheme"),
        (lambda p: _set(p, 3, 9), "index scheme"),
        (lambda p: _set(p, 8, 9), "layout"),
        (lambda p: _set_scale(p, float("nan")), "scale"),
        (lambda p: _set_scale(p, float("inf")), "scale"),
        (lambda p: _set_scale(p, -1.0), "scale"),
        (_code_15, "code above 14"),
        (lambda p: _set(p, len(p) - 1, 0xFF), "entries|increasing|outside"),
    ],
)
def test_hostile_payloads_are_remote_protocol_errors(mutate, why):
    s = _chunks(k=8)
    payload = demo_codec.encode(s, codec="int4")
    assert demo_codec.encoded_size(chunk=64, k=8, chunks=3, codec="int4") == payload.numel()
    with pytest.raises(RemoteProtocolError, match=why) as info:
        demo_codec.decode(mutate(payload.clone()), codec="int4", chunk=64, k=8, chunks=3, peer_id="peer-x")
    assert info.value.peer_id == "peer-x"


def test_repeated_indices_are_refused():
    s = sparse.SparseChunks(chunk=8, k=2, indices=torch.tensor([[3, 3]]), values=torch.tensor([[1.0, 2.0]]))
    payload = demo_codec.encode(s, codec="int8")  # 8 of 2: offsets, the smallest scheme here
    with pytest.raises(RemoteProtocolError, match="increasing"):
        demo_codec.decode(payload, codec="int8", chunk=8, k=2, chunks=1)


def test_a_payload_of_another_codec_is_refused():
    s = _chunks()
    with pytest.raises(RemoteProtocolError, match="not fp16"):
        demo_codec.decode(demo_codec.encode(s, codec="fp32"), codec="fp16", chunk=64, k=8, chunks=3)
    with pytest.raises(RemoteProtocolError, match="DeMo segment"):
        demo_codec.decode(demo_codec.encode(s, codec="fp16"), codec="int8", chunk=64, k=8, chunks=3)
    with pytest.raises(RemoteProtocolError, match="sparse payload"):
        demo_codec.decode(demo_codec.encode(s, codec="int8"), codec="fp16", chunk=64, k=8, chunks=3)
    with pytest.raises(RemoteProtocolError, match="4-bit values"):
        demo_codec.decode(demo_codec.encode(s, codec="int4"), codec="int8", chunk=64, k=8, chunks=3)
