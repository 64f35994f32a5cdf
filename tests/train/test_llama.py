import dataclasses

import pytest
import torch

from lattica.train.engine.checkpoint import weights_hash
from lattica.train.engine.llama import (
    LLAMA_PRESETS,
    LlamaConfig,
    _attention,
    build_llama,
    count_llama_parameters,
)
from lattica.train.engine.model import count_parameters, lm_loss

TINY = LLAMA_PRESETS["llama-tiny"].with_vocab(300)


def test_presets_span_a_cpu_model_to_about_1b_parameters():
    sizes = {name: count_llama_parameters(c.with_vocab(32_000)) for name, c in LLAMA_PRESETS.items()}
    assert sizes["llama-tiny"] < 3e6
    assert 15e6 <= sizes["llama-20m"] <= 25e6
    assert 120e6 <= sizes["llama-150m"] <= 170e6
    assert 0.9e9 <= sizes["llama-1b"] <= 1.2e9
    assert count_parameters(build_llama(TINY)) == count_llama_parameters(TINY)
    untied = dataclasses.replace(TINY, tied_head=False)
    assert count_parameters(build_llama(untied)) == count_llama_parameters(untied)


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_llama(TINY, seed=0)
    x = torch.randint(0, 300, (2, 32))
    logits = model(x)
    assert logits.shape == (2, 32, 300)
    uniform = torch.log(torch.tensor(300.0)).item()
    assert abs(lm_loss(logits, torch.randint(0, 300, (2, 32))).item() - uniform) < 0.3


def test_same_seed_same_weights_and_hash_other_seed_differs():
    a, b, c = build_llama(TINY, seed=3), build_llama(TINY, seed=3), build_llama(TINY, seed=4)
    assert weights_hash(a.state_dict()) == weights_hash(b.state_dict())
    assert weights_hash(a.state_dict()) != weights_hash(c.state_dict())


def test_tied_head_shares_the_embedding_untied_does_not():
    tied = build_llama(TINY)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = build_llama(dataclasses.replace(TINY, tied_head=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_causal_masking():
    model = build_llama(TINY, seed=0)
    x = torch.randint(0, 300, (1, 16))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 300
    assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1], atol=1e-6)


def test_grouped_query_attention_matches_repeated_key_value_heads():
    q = torch.randn(2, 8, 10, 16)
    k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True,
    )
    assert torch.allclose(_attention(q, k, v, groups=4), expected, atol=1e-6)


def test_rotary_positions_make_attention_depend_on_relative_order():
    model = build_llama(TINY, seed=0)
    x = torch.randint(0, 300, (1, 12))
    shifted = torch.cat([torch.randint(0, 300, (1, 4)), x], dim=1)
    # the same tokens at other positions give other logits (positions are encoded) …
    assert not torch.allclose(model(x)[0, -1], model(shifted)[0, -1], atol=1e-4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("d_model", 65, "divisible"),
        ("n_kv_head", 3, "multiple of n_kv_head"),
        ("vocab_size", 0, "positive integer"),
        ("rope_theta", float("nan"), "rope_theta"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **{field: value})


def test_longer_than_context_is_refused():
    model = build_llama(LlamaConfig(n_layer=1, d_model=16, n_head=2, n_kv_head=1, d_ff=32, context=4))
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, 5).long())


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_llama_with_the_same_weights_gives_the_same_logits(tied):
    transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'lattica[hf]')")
    from lattica.train.swarm.export import hf_llama_config

    config = dataclasses.replace(TINY, tied_head=tied)
    ours = build_llama(config, seed=1).eval()
    theirs = transformers.LlamaForCausalLM(hf_llama_config(config)).eval()
    theirs.load_state_dict(ours.state_dict())  # same parameter names
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(input_ids=x).logits, atol=1e-5)
