import pytest
import torch

from lattica.train.engine.quantize import (
    dequantize_4bit,
    encoded_size_4bit,
    mean_of_quantized,
    quantize_4bit,
    roundtrip_4bit,
)


def test_block_rounds_to_nearest_e2m1_point_after_absmax_scaling():
    # absmax 12 -> scale 2; x / 2 = [0.15, -6, 0.55, 1.3] -> grid [0, -6, 0.5, 1.5]
    x = torch.tensor([0.3, -12.0, 1.1, 2.6])
    q = quantize_4bit(x, block_size=4)
    assert q.scales.tolist() == [2.0]
    assert dequantize_4bit(q).tolist() == [0.0, -12.0, 1.0, 3.0]


def test_each_block_has_its_own_scale():
    x = torch.tensor([6.0, 3.0, 0.6, -0.3])
    out = roundtrip_4bit(x, block_size=2)
    # block 1: scale 1 -> [6, 3]; block 2: scale 0.1 -> [6, -3] * 0.1
    torch.testing.assert_close(out, torch.tensor([6.0, 3.0, 0.6, -0.3]))


def test_two_codes_per_byte_plus_fp32_scales():
    x = torch.randn(3, 50)
    q = quantize_4bit(x, block_size=64)
    # 150 values -> 3 blocks of 64 -> 96 bytes of codes + 3 scales
    assert q.codes.dtype == torch.uint8
    assert q.codes.numel() == 96
    assert q.nbytes == 96 + 12 == encoded_size_4bit(150, block_size=64)
    assert dequantize_4bit(q).shape == (3, 50)


def test_error_is_bounded_by_half_the_widest_gap():
    torch.manual_seed(0)
    x = torch.randn(4096) * 3
    q = quantize_4bit(x, block_size=32)
    err = (dequantize_4bit(q) - x).abs().view(-1, 32)
    assert bool((err <= q.scales[:, None] * 1.0 + 1e-6).all())
    assert float(err.max()) > 0  # the lossy path is really taken


def test_zero_block_decodes_to_zero():
    x = torch.zeros(8)
    assert roundtrip_4bit(x, block_size=4).tolist() == [0.0] * 8


def test_mean_dequantizes_then_sums_in_fp32():
    a = torch.tensor([6.0, -3.0])
    b = torch.tensor([2.0, 1.0])
    # both are exactly representable: scale 1 and scale 1/3
    mean = mean_of_quantized([quantize_4bit(a, block_size=2), quantize_4bit(b, block_size=2)])
    torch.testing.assert_close(mean, torch.tensor([4.0, -1.0]))


def test_odd_block_size_is_rejected():
    with pytest.raises(ValueError, match="even"):
        quantize_4bit(torch.ones(3), block_size=3)
