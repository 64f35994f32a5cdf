import math

import pytest
import torch

from lattica.train.engine.model import lm_loss
from lattica.train.engine.moe import (
    MoEConfig,
    MoEFeedForward,
    build_moe_model,
    dense_parameters,
    expert_parameters,
)


class Constant(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = torch.tensor(value)

    def forward(self, x):
        return x * 0 + self.value


def test_token_goes_to_top_k_experts_weighted_by_softmax_of_their_logits():
    ff = MoEFeedForward(d_model=2, num_experts=3, top_k=2, hidden=4)
    with torch.no_grad():
        # logits = [2x0, 0, x0] -> for x = (1, 0): [2, 0, 1] -> experts 0 and 2
        ff.router.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 0.0]]))
    ff.experts = torch.nn.ModuleList(
        [Constant([1.0, 0.0]), Constant([100.0, 100.0]), Constant([0.0, 1.0])]
    )
    out = ff(torch.tensor([[[1.0, 0.0]]]))
    w0 = math.exp(2) / (math.exp(2) + math.exp(1))
    torch.testing.assert_close(out, torch.tensor([[[w0, 1 - w0]]]))


def test_frozen_expert_is_routed_through_but_gets_no_gradient():
    torch.manual_seed(0)
    ff = MoEFeedForward(d_model=4, num_experts=2, top_k=2, hidden=8)
    for p in ff.experts[1].parameters():
        p.requires_grad_(False)
    x = torch.randn(1, 5, 4, requires_grad=True)
    ff(x).sum().backward()
    assert all(p.grad is None for p in ff.experts[1].parameters())
    assert all(p.grad is not None for p in ff.experts[0].parameters())
    assert ff.router.weight.grad is not None
    # the frozen expert still shapes the input gradient: silencing it changes x.grad
    routed_grad = x.grad.clone()
    x.grad = None
    with torch.no_grad():
        ff.experts[1].proj.weight.zero_()
        ff.experts[1].proj.bias.zero_()
    ff(x).sum().backward()
    assert not torch.allclose(x.grad, routed_grad)


def test_model_splits_into_experts_and_dense_and_trains():
    cfg = MoEConfig(
        n_layer=2, d_model=16, n_head=2, context=8, num_experts=4, top_k=2, expert_hidden=8
    )
    model = build_moe_model(cfg, seed=1)
    experts = expert_parameters(model)
    dense = dense_parameters(model)
    all_ids = [id(p) for p in model.parameters()]
    owned = [id(p) for ps in experts.values() for p in ps] + [id(p) for p in dense]
    assert sorted(owned) == sorted(all_ids)
    assert len(experts[0]) == 2 * 4  # two layers, fc + proj weights and biases
    assert id(model.blocks[0].moe.router.weight) in {id(p) for p in dense}

    idx = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        (loss + 0.01 * model.aux_loss).backward()
        opt.step()
    assert loss.item() < first - 0.5
    assert model.aux_loss.item() >= 1.0 - 1e-5  # E · Σ f·P is minimised at 1 by uniform routing


def test_same_seed_same_weights():
    a = build_moe_model("tiny-moe", seed=3)
    b = build_moe_model("tiny-moe", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_top_k_is_validated():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(n_layer=1, d_model=8, n_head=2, context=4, num_experts=2, top_k=3)
