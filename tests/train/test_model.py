import pytest
import torch

from lattica.train.engine.model import GPT, PRESETS, GPTConfig, build_model, count_parameters, lm_loss


def test_presets_span_100k_to_125m_parameters():
    sizes = {
        name: count_parameters(GPT(cfg)) for name, cfg in PRESETS.items() if cfg.d_model <= 256
    }
    assert 100_000 <= sizes["tiny"] <= 150_000
    # big presets: count analytically instead of allocating them
    big = PRESETS["gpt-125m"]
    per_layer = 12 * big.d_model**2 + 13 * big.d_model
    total = big.n_layer * per_layer + (big.vocab_size + big.context) * big.d_model + 2 * big.d_model
    assert 110e6 <= total <= 130e6


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_model("tiny", seed=0)
    x = torch.randint(0, 256, (2, 32))
    logits = model(x)
    assert logits.shape == (2, 32, 256)
    y = torch.randint(0, 256, (2, 32))
    assert abs(lm_loss(logits, y).item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_build_is_deterministic_per_seed():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_causal_masking():
    model = build_model(GPTConfig(n_layer=1, d_model=16, n_head=2, context=8), seed=0)
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 256
    assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1])


def test_validation_errors():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_layer=1, d_model=10, n_head=3, context=8)
    with pytest.raises(ValueError, match="unknown model preset"):
        build_model("huge")
    with pytest.raises(ValueError, match="exceeds the model context"):
        build_model(GPTConfig(n_layer=1, d_model=8, n_head=2, context=4))(torch.zeros(1, 5).long())
