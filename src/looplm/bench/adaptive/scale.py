"""Section ``scale`` of ``looplm bench adaptive``: the timing protocol on larger random-weight backbones, the
LM's measured exit depths replayed.
"""

from __future__ import annotations

import itertools

import torch

from .timing import _contenders, _timed


def _scale_model(mixer: str, d: int, dt):
    """A random-weight backbone of the scale section: 2 blocks × K = 4 loops at width ``d``, byte vocabulary;
    ``attention`` (Llama blocks, heads of 64) or ``mamba2`` (Mamba-2 blocks, heads of 64, d_state 64)."""
    from ...factory import build

    torch.manual_seed(0)
    common = {"d_model": d, "n_core": 2, "n_loops": 4, "vocab_size": 260, "max_seq_len": 1024}
    if mixer == "mamba2":
        return build(
            "tiny-mamba2", overrides={**common, "mamba.headdim": 64, "mamba.d_state": 64, "mamba.ngroups": 1}, dtype=dt
        ).eval()
    return build(
        "tiny-llama",
        overrides={
            **common,
            "d_ff": 3 * d,
            "attention.n_heads": d // 64,
            "attention.n_kv_heads": d // 64,
            "attention.head_dim": 64,
        },
        dtype=dt,
    ).eval()


def section_scale(
    depth_pool: torch.Tensor,
    widths,
    batches,
    new_tokens,
    runs,
    clock,
    dtypes,
    schedules=("token", "depth"),
    mixers=("attention",),
) -> list[dict]:
    """The timing protocol on larger random-weight backbones (2 blocks × K = 4 like the LM, wider; attention
    or Mamba-2 blocks), every token's depth drawn from the LM's measured exit depths (``depth_pool``): timing
    does not depend on the weights' values, only on how many loops run."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for mixer, d in itertools.product(mixers, widths):
        for dt in dtypes:
            m = _scale_model(mixer, d, dt)
            for B in batches:
                prompts = torch.randint(0, 260, (B, 32), generator=g)
                depths = depth_pool[torch.randint(0, depth_pool.numel(), (B, new_tokens + 8), generator=g)]
                spec = {"criterion": "replay", "depths": depths, "kv": "copy"}
                res = _timed(m, prompts, new_tokens, _contenders(m, B, {"replay": spec}, schedules), runs, clock)
                for name in list(res)[1:]:
                    r = res[name]
                    ex = r["stats"]["executed_ratio"]
                    rows.append(
                        {
                            "mixer": mixer,
                            "d_model": d,
                            "dtype": str(dt).replace("torch.", ""),
                            "batch": B,
                            "schedule": name.rsplit("/", 1)[1],
                            "executed_ratio": ex,
                            "batch_depth": r["stats"]["batch_depth"],
                            "time_ratio": r["ratio"],
                            "full_ms_per_token": res["full"]["ms_per_token"],
                            "target_met": r["ratio"] <= 1.1 * ex,
                            "clock": clock,
                        }
                    )
    return rows
