"""Model facts without memory: parameter counts (on the ``meta`` device), depths and forward FLOPs.

FLOPs convention (forward pass, per token, multiply-add = 2 FLOPs), at ``r`` loops and context ``T``:

* every ``nn.Linear`` executed: ``2 · in · out`` (prelude/coda once, core and rule ``r`` times, head once);
* causal attention scores and values: ``2 · 2 · n_heads · head_dim · (T + 1) / 2`` per attention layer
  execution (the mean causal context of a length-``T`` sequence);
* Mamba-2 SSD, recurrent form: ``6 · nheads · headdim · d_state`` per layer execution (decay·h,
  B·x outer product, C·h) plus the depthwise conv ``2 · conv_dim · d_conv``;
* element-wise operations (norms, activations, gates) are not counted.
"""

from __future__ import annotations

from torch import nn

from .config import ModelConfig


def _linear_flops(module: nn.Module) -> int:
    return sum(2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _block_extra_flops(block, cfg: ModelConfig, seq_len: int) -> int:
    if cfg.mixer_of(block.layer_idx) == "attention":
        return 2 * 2 * cfg.attention.n_heads * cfg.head_dim * (seq_len + 1) // 2
    mx = block.mixer
    nheads = mx.nheads if hasattr(mx, "nheads") else (cfg.mamba.expand * cfg.d_model) // cfg.mamba.headdim
    conv_dim = mx.conv1d.in_channels if hasattr(mx, "conv1d") else 0
    return 6 * nheads * cfg.mamba.headdim * cfg.mamba.d_state + 2 * conv_dim * cfg.mamba.d_conv


def forward_flops_per_token(model, num_loops: int | None = None, seq_len: int | None = None) -> int:
    cfg: ModelConfig = model.config
    r = cfg.n_loops if num_loops is None else num_loops
    T = seq_len or min(cfg.max_seq_len, 2048)
    total = 0
    for stack, times in ((model.prelude, 1), (model.core.stack, r), (model.coda, 1)):
        for blk in stack.blocks:
            total += times * (_linear_flops(blk) + _block_extra_flops(blk, cfg, T))
    total += r * _linear_flops(model.rule)
    total += _linear_flops(model.lm_head) if not isinstance(model.lm_head, nn.Identity) else 0
    return total


def model_info(spec, overrides=None, num_loops: int | None = None, seq_len: int | None = None) -> dict:
    """Everything ``looplm info`` prints, computed on the meta device."""
    from .factory import build

    model = build(spec, device="meta", overrides=overrides)
    cfg = model.config
    total = model.num_params()
    emb = model.embed.weight.numel() + (0 if cfg.tie_embeddings else model.lm_head.weight.numel())
    r = cfg.n_loops if num_loops is None else num_loops
    T = seq_len or min(cfg.max_seq_len, 2048)
    m = 1 + (cfg.pause.n_pause if getattr(cfg, "pause", None) is not None else 0)
    if m > 1 and seq_len is None:
        T = min(cfg.max_seq_len // m, 2048)  # real tokens: max_seq_len counts pause positions too
    return {
        "name": cfg.name,
        "description": cfg.description,
        "params": total,
        "embedding_params": emb,
        "non_embedding_params": total - emb,
        "rule_params": sum(p.numel() for p in model.rule.parameters()),
        "p_s_K_c": [cfg.n_prelude, cfg.n_core, cfg.n_loops, cfg.n_coda],
        "physical_depth": cfg.n_physical,
        "effective_depth": cfg.effective_depth(r),
        "num_loops": r,
        "rule": cfg.rule.name,
        "mixers": {k: sum(1 for i in range(cfg.n_physical) if cfg.mixer_of(i) == k) for k in ("attention", "mamba2")},
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "tie_embeddings": cfg.tie_embeddings,
        "seq_len_for_flops": T,
        # a Pause model runs 1 + n_pause positions per real token (over a context that many times longer)
        "positions_per_token": m,
        "forward_flops_per_token": m * forward_flops_per_token(model, r, T * m),
    }


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


__all__ = ["forward_flops_per_token", "model_info", "human"]
