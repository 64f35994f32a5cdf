"""A byte-level mixture-of-experts GPT: the GPT of ``model.py`` with a routed feed-forward.

Each block keeps causal self-attention and replaces the dense MLP by ``num_experts`` small MLPs
and a linear router. Every token goes to its ``top_k`` highest-scoring experts, weighted by the
softmax of those ``top_k`` router logits (Mixtral-style). A Switch-style load-balancing term is
left in ``model.aux_loss`` after each forward for trainers that want it.

Expert ``e`` of every layer forms one unit of ownership for SPES: ``expert_parameters(model)``
groups parameters by expert index, ``dense_parameters(model)`` returns everything else
(embeddings, attention, norms, routers). A frozen expert (``requires_grad`` False) is still
routed to and still passes gradients to its input; it only gets no gradient itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lattica.train.engine.model import GPT, VOCAB_SIZE, CausalSelfAttention, GPTConfig


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    n_layer: int
    d_model: int
    n_head: int
    context: int
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        GPTConfig(  # reuse the dense validation of the shared fields
            n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head, context=self.context
        )
        if self.num_experts < 1 or self.expert_hidden < 1:
            raise ValueError("num_experts and expert_hidden must be positive")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")

    def attention_config(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head, context=self.context
        )


MOE_PRESETS: dict[str, MoEConfig] = {
    "tiny-moe": MoEConfig(n_layer=2, d_model=64, n_head=4, context=128, num_experts=8, top_k=2),
    "small-moe": MoEConfig(
        n_layer=6, d_model=256, n_head=8, context=256, num_experts=16, top_k=2, expert_hidden=512
    ),
}


class Expert(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class MoEFeedForward(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, hidden) for _ in range(num_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        top_logits, top_index = logits.topk(self.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (top_index == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, weights[rows, slot, None] * expert(flat[rows]))
        self.aux_loss = _load_balance_loss(logits, top_index, len(self.experts))
        return out.view_as(x)


def _load_balance_loss(logits: torch.Tensor, top_index: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer balance term: E · Σ_e (share of assignments to e) · (mean prob of e)."""
    share = F.one_hot(top_index, experts).float().mean(dim=(0, 1))
    return experts * (share * logits.softmax(dim=-1).mean(dim=0)).sum()


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config.attention_config())
        self.ln2 = nn.LayerNorm(config.d_model)
        self.moe = MoEFeedForward(
            config.d_model, config.num_experts, config.top_k, config.expert_hidden
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.moe(self.ln2(x))
        return out


class MoEGPT(GPT):
    """The byte-level GPT with a mixture of experts in place of every MLP."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, block=MoEBlock)  # type: ignore[arg-type]
        # ``self.config`` is the same object, but GPT types it as the dense GPTConfig
        self.moe_config = config

    def moe_layers(self) -> list[MoEFeedForward]:
        """Each layer's mixture of experts, in order (every block of this model is a MoEBlock)."""
        return [block.moe for block in self.blocks if isinstance(block, MoEBlock)]

    @property
    def aux_loss(self) -> torch.Tensor:
        """Sum over layers of the load-balancing term of the last forward."""
        return sum((moe.aux_loss for moe in self.moe_layers()), torch.zeros(()))


def build_moe_model(config: MoEConfig | str, *, seed: int = 0) -> MoEGPT:
    """An MoE GPT from a config or preset name, initialised deterministically from ``seed``."""
    if isinstance(config, str):
        if config not in MOE_PRESETS:
            raise ValueError(f"unknown MoE preset {config!r}; choose one of {sorted(MOE_PRESETS)}")
        config = MOE_PRESETS[config]
    model = MoEGPT(config)
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                param.normal_(0.0, std, generator=generator)
    return model


def expert_parameters(model: MoEGPT) -> dict[int, list[nn.Parameter]]:
    """Expert index -> its parameters in every layer (the unit SPES assigns to an owner)."""
    grouped: dict[int, list[nn.Parameter]] = {e: [] for e in range(model.moe_config.num_experts)}
    for moe in model.moe_layers():
        for e, expert in enumerate(moe.experts):
            grouped[e].extend(expert.parameters())
    return grouped


def dense_parameters(model: MoEGPT) -> list[nn.Parameter]:
    """Every parameter that is not inside an expert, in ``model.parameters()`` order."""
    in_experts = {id(p) for params in expert_parameters(model).values() for p in params}
    return [p for p in model.parameters() if id(p) not in in_experts]
