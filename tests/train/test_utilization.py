"""MFU: model FLOPs per token of the built-in GPT, the peaks of known devices, and no figure
where either is unknown."""

from __future__ import annotations

import pytest
import torch

from lattica.train.engine.device import DeviceInfo
from lattica.train.engine.model import GPT, PRESETS, build_model
from lattica.train.engine.moe import build_moe_model
from lattica.train.engine.utilization import device_peak_flops, mfu, model_flops_per_token, peak_bf16_flops


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA B200", 2250.0),
    ],
)
def test_known_devices_have_their_dense_bf16_peak(name: str, tflops: float) -> None:
    assert peak_bf16_flops(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA A10G", "Tesla T4", "AMD Instinct MI300X", ""])
def test_an_unknown_device_has_no_peak(name: str) -> None:
    assert peak_bf16_flops(name) is None


def test_the_cpu_and_a_device_without_bf16_have_no_peak() -> None:
    assert device_peak_flops(DeviceInfo(torch.device("cpu"), None)) is None
    assert device_peak_flops(DeviceInfo(torch.device("cuda"), None)) is None  # fp32: another peak


def test_gpt_flops_per_token_are_six_per_matmul_parameter_plus_attention() -> None:
    model = build_model("tiny")
    config = PRESETS["tiny"]
    params = sum(p.numel() for p in model.parameters())  # the head is tied to the token table
    matmul = params - config.context * config.d_model  # the position table is a lookup
    assert model_flops_per_token(model, seq_len=100) == 6 * matmul + 12 * config.n_layer * config.d_model * 100


def test_gpt2_small_shape_costs_about_625_mflop_per_token_at_1024() -> None:
    model = GPT(PRESETS["gpt2-124m"])
    flops = model_flops_per_token(model, seq_len=1024)
    assert flops == pytest.approx(6.245e8, rel=1e-3)
    # 511,470 tokens/s on a 989 TFLOP/s device is about a third of its peak
    assert mfu(flops, 511_470, 989e12) == pytest.approx(0.323, abs=1e-3)


def test_models_whose_flops_are_not_counted_have_no_mfu() -> None:
    assert model_flops_per_token(build_moe_model("tiny-moe"), seq_len=64) is None
    assert model_flops_per_token(torch.nn.Linear(4, 4), seq_len=64) is None
    assert mfu(None, 1000.0, 989e12) is None
    assert mfu(1e6, 1000.0, None) is None
