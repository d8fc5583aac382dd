"""Parity with Hugging Face transformers: imported Llama / Qwen3 / Mamba2 give the same logits (fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from looplm.interop import from_transformers, to_config  # noqa: E402


def _compare(hf, x, atol=1e-4, **kw):
    hf.eval()
    model = from_transformers(hf, **kw).eval()
    with torch.no_grad():
        a = hf(x).logits
        b = model(x).logits
    torch.testing.assert_close(b, a, atol=atol, rtol=1e-4)
    return model


def test_llama_with_llama3_rope_scaling_matches():
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    )
    model = _compare(transformers.LlamaForCausalLM(cfg), torch.randint(0, 300, (2, 100)))
    assert model.config.attention.rope_scaling is not None and model.config.n_kv_heads == 1


def test_qwen3_with_qk_norm_and_tied_embeddings_matches():
    cfg = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    )
    model = _compare(transformers.Qwen3ForCausalLM(cfg), torch.randint(0, 300, (2, 50)))
    assert model.config.attention.qk_norm and model.config.tie_embeddings


def test_mamba2_matches():
    cfg = transformers.Mamba2Config(
        vocab_size=300,
        hidden_size=64,
        state_size=16,
        num_hidden_layers=2,
        expand=2,
        head_dim=16,
        num_heads=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        tie_word_embeddings=False,
        use_conv_bias=True,
        use_bias=False,
    )
    hf = transformers.Mamba2ForCausalLM(cfg)
    _compare(hf, torch.randint(0, 300, (2, 37)))


def test_imported_stack_can_be_looped_and_decoded():
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    looped = from_transformers(hf, n_loops=3).eval()
    x = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        assert not torch.allclose(looped(x).logits, hf(x).logits, atol=1e-3)
        torch.testing.assert_close(looped(x, num_loops=1).logits, hf(x).logits, atol=1e-4, rtol=1e-4)
    ours = looped.generate(x, max_new_tokens=6, num_loops=1)
    theirs = hf.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_unsupported_models_are_refused():
    with pytest.raises(ValueError, match="model_type"):
        to_config(transformers.GPT2Config())
