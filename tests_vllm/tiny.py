"""Tiny random looplm models for the vLLM plugin's tests, exported as vLLM serves them.

Each variant is a shipped tiny preset (or one with another recurrence rule / norm placement) at head dim 32:
vLLM's CPU attention runs head sizes 32, 64, 80, ... (not the presets' 16). Every parameter is perturbed
away from its initialisation (the rules' gates and adapters start as the identity: a test of them at their
init would not see their arithmetic), a little more strongly in the head, so that greedy choices are not
near-ties between 260 almost equal logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import looplm
from looplm.hf.export import export_hf
from looplm.hf.public import export_original

HD32 = {"attention.head_dim": 32}
SMALL = {
    "vocab_size": 260,
    "d_model": 64,
    "n_core": 2,
    "n_loops": 3,
    "d_ff": 128,
    "attention.n_heads": 2,
    "attention.n_kv_heads": 2,
    "attention.head_dim": 32,
    "max_seq_len": 512,
}
VARIANTS: dict[str, tuple[str, dict]] = {
    # the attention presets
    "tiny-llama": ("tiny-llama", HD32),
    "tiny-qwen3": ("tiny-qwen3", HD32),  # QK-norm, tied head
    "tiny-coreloop": ("tiny-coreloop", HD32),  # (1, 2, 3, 1), Llama-3 RoPE scaling, 1 KV head
    "tiny-stateloop": ("tiny-stateloop", HD32),  # StateLoop rule (identity mixer), embed scale
    # StateLoop's attention state mixer (eq. 8): its own slot per iteration, 1 head of 64 beside the blocks' 32
    "stateloop-attn": (
        "tiny-stateloop",
        {**HD32, "rule.options.mixer": "attention", "rule.options.mixer_head_dim": 64},
    ),
    # other rules and block forms on tiny-llama
    "injection-dense": ("tiny-llama", {**HD32, "rule": {"name": "injection", "options": {"form": "dense"}}}),
    "timestep-adaln": ("tiny-llama", {**HD32, "rule": {"name": "timestep", "options": {"gating": "adaln"}}}),
    "hyperloop": ("tiny-llama", {**HD32, "rule": {"name": "hyperloop", "options": {"n_streams": 2}}}),
    "exit-gate-sandwich": (
        "tiny-llama",
        {
            **HD32,
            "norm_placement": "sandwich",
            "rule": {"name": "exit_gate", "options": {"inter_norm": True, "gate_norm": True, "threshold": 0.5}},
        },
    ),
    # Ouro's and Huginn's architectures, small (written in their original formats by the tests)
    "ouro": ("ouro-1.4b", {**SMALL, "rule.options.threshold": 0.7}),
    "huginn": ("huginn-0125", {**SMALL, "n_prelude": 1, "n_coda": 1, "init_std": 0.02}),
    # refused: Mamba-2 blocks with per-token exit (MAMBA_VARIANTS are served)
    "tiny-hybrid": ("tiny-hybrid", {}),
}
# served at --tensor-parallel-size 2 (test_tensor_parallel.py): 4 query heads and 2 KV heads, so each rank
# gets 2 and 1; d_ff 176 splits into 88 per rank; the rules' parameters stay whole on each rank
KV2 = {**HD32, "attention.n_kv_heads": 2}
TP_VARIANTS: dict[str, tuple[str, dict]] = {
    "tp-coreloop": ("tiny-coreloop", KV2),  # (1, 2, 3, 1), Llama-3 RoPE scaling
    "tp-timestep-adaln": ("tiny-llama", {**KV2, "rule": {"name": "timestep", "options": {"gating": "adaln"}}}),
    "tp-injection-qwen3": ("tiny-qwen3", {**KV2, "rule": {"name": "injection", "options": {"form": "dense"}}}),
    # StateLoop's attention mixer: its 2 heads stay whole on each rank (the rule is replicated)
    "tp-stateloop-attn": (
        "tiny-stateloop",
        {**KV2, "rule.options.mixer": "attention", "rule.options.mixer_head_dim": 32},
    ),
}
# served at --pipeline-parallel-size 2 (test_pipeline_parallel.py): the stages split between prelude, core and coda
PP_VARIANTS: dict[str, tuple[str, dict]] = {
    # (1, 2, 3, 1): rank 0 the prelude, rank 1 the core and the coda; E crosses to the core (dense injection reads it)
    "pp-coreloop-injection": ("tiny-coreloop", {**HD32, "rule": {"name": "injection", "options": {"form": "dense"}}}),
    # (0, 2, 3, 1): rank 0 the core (QK-norm; the rule's inter-loop norm is the final norm N, read there), rank 1
    # the coda and the tied head (the embedding there too)
    "pp-qwen3-coda": (
        "tiny-qwen3",
        {**HD32, "n_coda": 1, "rule": {"name": "vanilla", "options": {"inter_norm": True}}},
    ),
}

# Mamba-2 blocks through vLLM's Mamba-2 layer (test_mamba.py): the presets' Mamba-2 shapes (head dim 16, state 16),
# attention at head dim 32
MAMBA_VARIANTS: dict[str, tuple[str, dict]] = {
    "mamba2-loop": ("tiny-mamba2", {}),  # (0, 2, 3, 0), Mamba-2 only, 2 groups
    "hybrid-loop": ("tiny-hybrid", HD32),  # (0, 3, 2, 0), attention at layer 1 (partial RoPE), 1 group
    # Mamba-2 prelude and coda around a hybrid core, sandwich norms, an MLP, dense injection
    "hybrid-prelude-coda": (
        "tiny-hybrid",
        {
            **HD32,
            "n_prelude": 1,
            "n_coda": 1,
            "attn_layer_idx": [2],
            "d_ff": 96,
            "norm_placement": "sandwich",
            "rule": {"name": "injection", "options": {"form": "dense"}},
        },
    ),
}


def build_tiny(name: str, seed: int = 0) -> looplm.LoopedLM:
    preset, overrides = {**VARIANTS, **TP_VARIANTS, **PP_VARIANTS, **MAMBA_VARIANTS}[name]
    torch.manual_seed(seed)
    model = looplm.build(looplm.load_model_config(preset, overrides)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            scale = 0.3 if pname in ("lm_head.weight", "embed.weight") else 0.05
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def write_tiny(name: str, out: Path, seed: int = 0, fmt: str = "looplm") -> tuple[looplm.LoopedLM, Path]:
    """Build variant ``name`` and write it to ``out`` (``fmt``: looplm's export, or ``original`` for Ouro / Huginn)."""
    model = build_tiny(name, seed)
    if fmt == "original":
        export_original(model, out, tokenizer="byte")
    else:
        export_hf(model, out, tokenizer="byte", overwrite=True)
    return model, out


def serve_runs(root: Path, runs: list, env: dict | None = None, kv_gib: str = "1", timeout: float = 600) -> dict:
    """Serve ``runs`` (``serve_tiny.py``'s job: one dict per model) with vLLM's offline ``LLM`` in one subprocess, the
    engine in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``env``: more environment; ``kv_gib``:
    ``VLLM_CPU_KVCACHE_SPACE`` unless set. Returns serve_tiny.py's result (``{"runs": [...]}``); raises with its
    stderr's tail when it fails."""
    job, result = root / "job.json", root / "result.json"
    job.write_text(json.dumps({"runs": runs}))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_gib)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "serve_tiny.py"), str(job), str(result)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"serve_tiny.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def serve_named(root: Path, runs: list, **kw) -> dict:
    """:func:`serve_runs` (``kw``: its options), the results by run name; prints each run's load + generate time."""
    out = {r["name"]: r for r in serve_runs(root, runs, **kw)["runs"]}
    print("\nvLLM load + generate, seconds:", {n: r["seconds"] for n, r in out.items()})
    return out
