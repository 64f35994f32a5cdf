"""A byte-level GPT (decoder-only transformer) with size presets.

The vocabulary is the 256 byte values, so no tokenizer files are needed anywhere. The
architecture follows GPT-2: learned positions, pre-norm blocks of causal self-attention and a
4x MLP, tied input/output embeddings. Presets span ~100k parameters ("tiny", trains visibly on a
laptop CPU in a minute) to the GPT-2 small shape ("gpt2-124m"; with a 256-symbol vocabulary the
embedding is smaller than GPT-2's, so it holds ~86M parameters), "gpt-125m" (~125M) and
"gpt-350m" (the GPT-2 medium shape, ~302M).

Initialisation is seeded explicitly (``build_model(config, seed=...)``) so that every replica of
a run can start from identical weights without shipping them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB_SIZE = 256


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    d_model: int
    n_head: int
    context: int
    vocab_size: int = VOCAB_SIZE
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "context", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, context=128),
    "mini": GPTConfig(n_layer=4, d_model=128, n_head=4, context=256),
    "small": GPTConfig(n_layer=6, d_model=256, n_head=8, context=256),
    "medium": GPTConfig(n_layer=8, d_model=512, n_head=8, context=512),
    "gpt2-124m": GPTConfig(n_layer=12, d_model=768, n_head=12, context=1024),
    "gpt-125m": GPTConfig(n_layer=17, d_model=768, n_head=12, context=1024),
    "gpt-350m": GPTConfig(n_layer=24, d_model=1024, n_head=16, context=1024),
}


def preset(name: str) -> GPTConfig:
    """The config of a named preset; ``ValueError`` lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}"
        ) from None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class GPT(nn.Module):
    """``forward(idx)`` maps int64 token ids ``(B, T)`` to logits ``(B, T, vocab)``."""

    def __init__(self, config: GPTConfig, *, block: Callable[[Any], nn.Module] | None = None) -> None:
        """``block(config)`` builds each transformer layer (the MoE variant passes its own)."""
        super().__init__()
        self.config = config
        make_block = block or Block
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(make_block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.config.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _init_weights(model: GPT, generator: torch.Generator) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # LayerNorm gains
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                param.normal_(0.0, std, generator=generator)


def build_model(config: GPTConfig | str, *, seed: int = 0) -> GPT:
    """A GPT from a config or preset name, initialised deterministically from ``seed``."""
    if isinstance(config, str):
        config = preset(config)
    model = GPT(config)
    generator = torch.Generator().manual_seed(seed)
    _init_weights(model, generator)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats (= nats per byte for byte-level data)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
