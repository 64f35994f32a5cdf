"""Model FLOPs utilisation (MFU): how much of the device's dense bf16 peak the inner steps use.

MFU = model FLOPs per token × tokens per second ÷ the device's peak. The FLOPs of one token's
forward and backward pass are counted as in the PaLM paper (Chowdhery et al., 2022, appendix
B) and nanoGPT: 6 per parameter (2 in the forward matmuls, 4 in backward) plus
12 · n_layer · d_model · T for attention's scores and weighted values over a context of T.
The position table is left out (a lookup, no matmul); the token table is counted, since it is
tied to the output head. Recomputed activations (activation checkpointing) do not count: MFU
counts the model's FLOPs, not the hardware's. Only the built-in dense GPT is counted; a mixture
of experts (each token uses some experts) or a user's model has no MFU — a figure we cannot
derive is left out, not guessed.

Peaks: dense (not sparse) bf16 tensor-core TFLOP/s from the vendors' data sheets, matched by
device name. An unknown device, the CPU, and a device training without bf16 autocast (whose
peak would be another) have no MFU (``None``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lattica.train.engine.device import DeviceInfo
from lattica.train.engine.model import GPT

# (pattern of torch.cuda.get_device_name, dense bf16 TFLOP/s); the first match wins
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGH200\b", 989.0),
    (r"\bH200 NVL\b", 835.0),
    (r"\bH200\b", 989.0),
    (r"\bH100 NVL\b", 835.0),
    (r"\bH100 PCIe\b", 756.0),
    (r"\bH100\b", 989.0),  # SXM ("H100 80GB HBM3")
    (r"\bB200\b", 2250.0),
    (r"\bA100\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of a device by its name; None when it is not in the table."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops * 1e12
    return None


def device_peak_flops(device: DeviceInfo) -> float | None:
    """The peak that MFU divides by on ``device`` (None: no MFU there, module docstring)."""
    if device.device.type != "cuda" or device.autocast_dtype != torch.bfloat16:
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device.device))


def model_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Forward + backward FLOPs per trained token of the built-in dense GPT; None otherwise."""
    if type(model) is not GPT:
        return None
    config = model.config
    matmul_params = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    return 6.0 * matmul_params + 12.0 * config.n_layer * config.d_model * seq_len


def mfu(flops_per_token: float | None, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """The fraction of the peak used, or None when either figure is unknown."""
    if flops_per_token is None or peak_flops is None or peak_flops <= 0:
        return None
    return flops_per_token * tokens_per_s / peak_flops
