"""Every paper preset has exactly the parameter count printed in its paper (meta device, no memory)."""

import pytest
import torch

import looplm
from looplm.config import list_presets, load_model_config, preset_dict

from helpers import tiny_variant

EXACT = {
    "llama3.1-1b": 1_007_482_368,
    "qwen3-0.6b": 596_049_920,
}
# printed rounded to 0.01M in the papers
ROUNDED_M = {
    "qwen3-0.6b-baseloop-2x14": 187.05,
    "qwen3-0.6b-baseloop-4x7": 218.51,
    "qwen3-0.6b-baseloop-7x4": 265.70,
    "qwen3-0.6b-baseloop-14x2": 375.82,
    "llama3.1-1b-baseloop-2x10": 455.35,
    "llama3.1-1b-baseloop-4x5": 516.70,
    "llama3.1-1b-baseloop-5x4": 547.37,
    "llama3.1-1b-baseloop-10x2": 700.74,
    "stateloop-1.4b-vanilla": 1420.92,
    "stateloop-1.4b-vanilla-k5": 1420.92,
    "stateloop-1.4b-vanilla-ffn": 1467.22,
    **{f"stateloop-410m-vanilla-k{k}": 406.90 for k in (3, 4, 5, 6, 7)},
}


def count(name):
    return looplm.build(name, device="meta").num_params()


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_sizes(name):
    assert count(name) == EXACT[name]


@pytest.mark.parametrize("name", sorted(ROUNDED_M))
def test_rounded_sizes(name):
    assert round(count(name) / 1e6, 2) == ROUNDED_M[name]


def test_looped_mamba_sizes_and_depths():
    # Mamba-2 140M with the mamba_ssm defaults the paper leaves implicit; 370M likewise
    assert count("mamba2-140m") == 139_520_448
    assert count("llama2-140m") == 141_202_176
    for r in (2, 4):
        assert count(f"mamba2-140m-loop{r}") == count("mamba2-140m")
    # iso-FLOPs grid: N⊗R has the parameters of N⊗1 and the effective depth of (NR)⊗1
    for arch in ("mamba2", "llama2"):
        assert count(f"{arch}-6x4") == count(f"{arch}-6x1") < count(f"{arch}-12x1") == count(f"{arch}-12x2")
        assert (
            load_model_config(f"{arch}-6x4").effective_depth()
            == load_model_config(f"{arch}-24x1").effective_depth()
            == 24
        )
    hy = load_model_config("mamba2-hybrid-140m")
    assert [hy.mixer_of(i) for i in range(24)].count("attention") == 4 and hy.attn_layer_idx == [5, 10, 15, 20]
    assert load_model_config("mamba2-hybrid-370m").attn_layer_idx == [6, 18, 30, 42]


def test_tiny_presets_are_tiny():
    for name in list_presets():
        if name.startswith("tiny-"):
            assert 10_000 < count(name) < 1_000_000, name


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_yaml_validates(name):
    cfg = load_model_config(name)
    assert cfg.name == name
    assert preset_dict(name).get("description"), f"{name} has no description"


@pytest.mark.parametrize("name", [n for n in list_presets() if not n.startswith("tiny-")])
def test_tiny_variant_of_every_real_preset_runs_and_decodes(name):
    """Same structure as the real preset at toy width: forward/backward, and cached decoding == full forward."""
    real = load_model_config(name)
    cfg = tiny_variant(
        name,
        n_core=min(real.n_core, 3),
        n_loops=min(real.n_loops, 4),
        attn_layer_idx=[1] if real.attn_layer_idx else [],
    )
    model = looplm.LoopedLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    out = model(x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2)
        pre = model(x[:, :7], cache=cache).logits
        steps = [model(x[:, t : t + 1], cache=cache).logits for t in range(7, 12)]
    torch.testing.assert_close(torch.cat([pre] + steps, 1), full, atol=2e-5, rtol=1e-4)
