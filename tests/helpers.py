"""Test helpers: tiny variants of the real presets (same structure, toy widths); the rerun of a test
file under the extension's portable build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from looplm.config import ModelConfig, preset_dict


def run_under_portable_build(test_file: str) -> str:
    """Every other test of ``test_file`` in a fresh process with ``LOOPLM_CPU_KERNELS=portable`` (the
    build CPUs without AVX512-BF16 get); fails with its output unless they pass. Returns pytest's output.
    Skips where this CPU's own build is already that one (no AVX512-BF16): the file's other tests just ran it."""
    import pytest

    from looplm.kernels import loader

    var = loader.variant()[0]
    if var != "avx512bf16":
        pytest.skip(f"this CPU gets the portable build ({var}) itself: the other tests of this file ran on it")
    env = dict(os.environ, LOOPLM_CPU_KERNELS="portable")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "not portable_build", test_file],
        env=env,
        cwd=Path(test_file).parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
    return r.stdout


def assert_refused_before_any_work(model, call, match: str) -> None:
    """``call()`` raises a ``ValueError`` matching ``match`` before ``model`` embeds a single token."""
    import pytest

    calls = []
    hook = model.embed.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            call()
    finally:
        hook.remove()
    assert not calls


# toy sizes of the token mixers a rule owns (StateLoop's attention / Mamba-2 mixers over the state)
TINY_RULE_OPTIONS = {
    "mixer_head_dim": 16,
    "mamba_d_state": 8,
    "mamba_headdim": 16,
    "mamba_ngroups": 2,
    "mamba_chunk_size": 8,
}


def tiny_variant(name: str, **extra) -> ModelConfig:
    """The preset's structure — (p, s, K, c), mixers and attention indices, GQA ratio, QK-norm, tied
    embeddings, RoPE scaling, embedding scale, rule — at toy widths, so every real preset runs in tests."""
    d = preset_dict(name)
    d_model = d.get("d_model", 64)
    d.update(vocab_size=128, d_model=64, max_seq_len=64)
    if d.get("d_ff", 0):
        d["d_ff"] = 96
    att = dict(d.get("attention") or {})
    n_heads = att.get("n_heads", 4)
    ratio = n_heads // (att.get("n_kv_heads") or n_heads)
    att.update(n_heads=4, n_kv_heads=max(1, 4 // ratio), head_dim=16)
    if att.get("rotary_dim"):
        att["rotary_dim"] = 8
    if att.get("rope_scaling"):
        att["rope_scaling"] = dict(att["rope_scaling"], original_max_position_embeddings=16)
    d["attention"] = att
    if d.get("mixer") == "mamba2":
        d["mamba"] = dict(d.get("mamba") or {}, d_state=8, headdim=16, ngroups=1, chunk_size=8)
    rule = dict(d.get("rule") or {})
    if rule.get("options"):  # a rule's own widths shrink with the backbone (e.g. StateLoop's d_s and mixers)
        opts = dict(rule["options"])
        if opts.get("d_s"):
            opts["d_s"] = max(8, opts["d_s"] * 64 // d_model)
        opts.update({k: v for k, v in TINY_RULE_OPTIONS.items() if k in opts})
        d["rule"] = dict(rule, options=opts)
    d.update(extra)
    return ModelConfig.from_dict(d)


def assert_cached_equals_full(model, T: int = 11, split: int = 5, atol: float = 3e-5):
    """Prefill, a two-token continuation and single steps through a decoding cache == one full forward.
    Returns the cache (callers inspect its slots)."""
    import torch

    model.eval()
    x = torch.randint(0, model.config.vocab_size, (2, T))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2)
        parts = [model(x[:, :split], cache=cache).logits, model(x[:, split : split + 2], cache=cache).logits]
        parts += [model(x[:, t : t + 1], cache=cache).logits for t in range(split + 2, T)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=atol, rtol=1e-4)
    return cache


def assert_padded_equals_alone(model, num_loops=None, atol: float = 3e-5):
    """A left-padded batch of two rows == each row alone (per-row ``num_loops``: each at its own depth)."""
    import torch

    model.eval()
    V = model.config.vocab_size
    a, b = torch.randint(0, V, (1, 9)), torch.randint(0, V, (1, 5))
    ids, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 4:], mask[1, 4:] = b[0], 1
    ra, rb = (None, None) if num_loops is None else (int(num_loops[0]), int(num_loops[1]))
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, num_loops=num_loops).logits
        alone_a, alone_b = model(a, num_loops=ra).logits, model(b, num_loops=rb).logits
    torch.testing.assert_close(batch[0], alone_a[0], atol=atol, rtol=1e-4)
    torch.testing.assert_close(batch[1, 4:], alone_b[0], atol=atol, rtol=1e-4)
