"""Codecs: bit-exact raw/fp32 round trips, documented error bounds, header validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lattica.errors import LocalProtocolError, RemoteProtocolError
from lattica.numerics import codecs

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (65,), (4, 33), (2, 3, 5, 7)]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _wire_roundtrip(t: torch.Tensor, codec: str) -> torch.Tensor:
    spec, payload = codecs.encode(t, codec, "x")
    spec2 = codecs.spec_from_wire(spec.to_wire())
    assert spec2 == spec
    assert len(payload) == spec.payload_size
    return codecs.decode(spec2, bytearray(payload))


@pytest.mark.parametrize("dtype", list(codecs.DTYPES.values()))
@pytest.mark.parametrize("shape", SHAPES)
def test_raw_round_trip_is_bit_exact(dtype, shape):
    t = _sample(dtype, shape)
    out = _wire_roundtrip(t, "raw")
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert torch.equal(out.view(torch.uint8) if out.dim() else out, t.view(torch.uint8) if t.dim() else t)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_codec_is_bit_exact_for_fp32_including_specials(shape):
    t = _sample(torch.float32, shape)
    if t.numel() >= 3:
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    out = _wire_roundtrip(t, "fp32")
    assert out.reshape(-1).view(torch.int32).tolist() == t.reshape(-1).view(torch.int32).tolist()


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_integer_tensors_travel_raw_whatever_the_codec(codec):
    t = torch.arange(-5, 300, dtype=torch.int64)
    assert torch.equal(_wire_roundtrip(t, codec), t)


@pytest.mark.parametrize(("codec", "rel"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_float_codecs_relative_error(codec, rel):
    t = torch.randn(10_000) * 1000
    out = _wire_roundtrip(t, codec)
    assert ((out - t).abs() <= t.abs() * rel).all()


@pytest.mark.parametrize(("codec", "steps"), [("int8", 254), ("int4", 14)])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_block_quantizers_within_documented_bound(codec, steps, numel):
    t = torch.randn(numel) * torch.logspace(-3, 3, numel)
    out = _wire_roundtrip(t, codec)
    padded = torch.zeros(-(-numel // codecs.BLOCK) * codecs.BLOCK)
    padded[:numel] = t
    absmax = padded.view(-1, codecs.BLOCK).abs().amax(1).repeat_interleave(codecs.BLOCK)[:numel]
    assert ((out - t).abs() <= absmax / steps * (1 + 1e-5) + 1e-30).all()


@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=300),
    st.sampled_from(["int8", "int4", "fp16", "bf16"]),
)
@settings(max_examples=60, deadline=None)
def test_lossy_bounds_hold_for_arbitrary_values(values, codec):
    t = torch.tensor(values, dtype=torch.float32)
    out = _wire_roundtrip(t, codec)
    assert out.shape == t.shape
    if codec in ("int8", "int4") and values:
        steps = 254 if codec == "int8" else 14
        # relative to the block's largest value; below float32's smallest normal number the
        # scale itself is subnormal and only an absolute bound of that size holds
        tiny = torch.finfo(torch.float32).tiny
        assert (out - t).abs().max() <= t.abs().max() / steps * (1 + 1e-5) + tiny


def test_quantizers_refuse_non_finite_input():
    with pytest.raises(LocalProtocolError):
        codecs.encode(torch.tensor([1.0, float("nan")]), "int8")


def test_error_feedback_keeps_the_running_sum_close():
    ef = codecs.ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    truth, sent = torch.zeros(256), torch.zeros(256)
    for _ in range(50):
        x = torch.randn(256, generator=gen)
        truth += x
        sent += codecs.roundtrip(ef.compensate("w", x, "int4"), "int4")
    # Without feedback the error of the sum grows like sqrt(steps); with it, it stays one step.
    assert (truth - sent).abs().max() < 0.5


@pytest.mark.parametrize(
    "bad",
    [
        None, [], ["x", "float32", [2]], ["x", "complex64", [2], "raw"], ["x", "float32", [2], "zip"],
        ["x", "int32", [2], "int8"], ["x", "float32", [-1], "raw"], ["x", "float32", [2.0], "raw"],
        ["x", "float32", [1 << 30, 1 << 30], "raw"], ["x", "float32", [1] * 40, "raw"],
        [7, "float32", [2], "raw"], ["x", "float32", [True], "raw"],
    ],
)
def test_invalid_headers_are_remote_protocol_errors(bad):
    with pytest.raises(RemoteProtocolError):
        codecs.spec_from_wire(bad, peer_id="Qm")


def test_payload_size_mismatch_and_bad_scales_are_remote_errors():
    spec, payload = codecs.encode(torch.randn(100), "int8")
    with pytest.raises(RemoteProtocolError):
        codecs.decode(spec, bytearray(payload)[:-1])
    forged = bytearray(payload)
    forged[0:4] = b"\xff\xff\xff\xff"  # a NaN scale
    with pytest.raises(RemoteProtocolError):
        codecs.decode(spec, forged)
