"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention) with presets.

The architecture is the one of Llama 2/3: pre-norm blocks with RMSNorm, rotary position
embeddings applied to queries and keys (the "rotate half" layout), attention through
``F.scaled_dot_product_attention`` with fewer key/value heads than query heads (each key/value
head serves ``n_head / n_kv_head`` query heads), a SwiGLU MLP (``down(silu(gate(x)) * up(x))``),
no biases, and an output head tied to the input embedding or not.

Parameter names are those of transformers' ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj
.weight`` …), and the arithmetic follows it (RMSNorm in fp32, the same rotary frequencies), so
``lattica export --format hf`` writes the weights unchanged and transformers computes the same
logits (``lattica.train.swarm.export``).

The vocabulary comes from the data: a preset's ``vocab_size`` is replaced by the tokenizer's
(``with_vocab``). Initialisation is seeded explicitly, as for the GPT presets: N(0, 0.02), the
output projections of attention and MLP scaled by 1/sqrt(2 n_layer), norm gains 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int  # the SwiGLU hidden width
    context: int
    vocab_size: int = 256
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tied_head: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "context", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: the head dimension ({self.d_model // self.n_head}) must be even (rotary)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"LlamaConfig.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if not (math.isfinite(self.norm_eps) and 0 < self.norm_eps < 1):
            raise ValueError(f"LlamaConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def with_vocab(self, vocab_size: int) -> LlamaConfig:
        return dataclasses.replace(self, vocab_size=vocab_size)


# Sizes from a CPU test model to ~1B. Parameter counts depend on the vocabulary: the table in
# docs/training.md gives them at a 32,000-token vocabulary (``count_llama_parameters``).
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=176, context=128),
    "llama-20m": LlamaConfig(n_layer=6, d_model=384, n_head=6, n_kv_head=2, d_ff=1024, context=512),
    "llama-150m": LlamaConfig(n_layer=16, d_model=768, n_head=12, n_kv_head=4, d_ff=2560, context=1024),
    # the TinyLlama shape: 22 layers of 2048, 4 key/value heads, an untied head
    "llama-1b": LlamaConfig(
        n_layer=22, d_model=2048, n_head=32, n_kv_head=4, d_ff=5632, context=2048, tied_head=False,
    ),
}


def count_llama_parameters(config: LlamaConfig) -> int:
    """The parameter count of ``config`` without building it."""
    d, kv = config.d_model, config.n_kv_head * config.head_dim
    attention = d * d * 2 + d * kv * 2
    mlp = 3 * d * config.d_ff
    per_layer = attention + mlp + 2 * d
    head = 0 if config.tied_head else config.vocab_size * d
    return config.vocab_size * d + config.n_layer * per_layer + d + head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(dtype)
        return out


def rotary_tables(config: LlamaConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape ``(length, head_dim)`` (the two halves repeat)."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** half)
    angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    both = torch.cat((angles, angles), dim=-1)
    return both.cos(), both.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, heads, T, head_dim)`` by the angles of its positions."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        d, kv = config.d_model, config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.n_head, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.n_kv_head, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = _attention(q, k, v, groups=c.n_head // c.n_kv_head)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, c.d_model))
        return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int) -> torch.Tensor:
    """Causal attention where each key/value head serves ``groups`` consecutive query heads."""
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# torch >= 2.5 lets SDPA broadcast key/value heads itself (no copy)
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaBody(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)


class Llama(nn.Module):
    """``forward(idx)`` maps int64 token ids ``(B, T)`` to logits ``(B, T, vocab)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.config.context}")
        cos, sin = rotary_tables(self.config, t, idx.device)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


def _init_weights(model: Llama, generator: torch.Generator) -> None:
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is listed once
            if param.dim() == 1:  # RMSNorm gains
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                param.normal_(0.0, std, generator=generator)


def build_llama(config: LlamaConfig, *, seed: int = 0) -> Llama:
    """A Llama from ``config``, initialised deterministically from ``seed``."""
    model = Llama(config)
    _init_weights(model, torch.Generator().manual_seed(seed))
    return model
