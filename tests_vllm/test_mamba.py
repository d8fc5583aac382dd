"""Looped Mamba-2 and hybrid Mamba-2/attention designs on vLLM's Mamba-2 layer and state cache, against looplm,
in fp32 on vLLM's CPU build (docs/vllm.md).

Tiny random models (``tiny.MAMBA_VARIANTS``: a pure looped Mamba-2 ``(0, 2, 3, 0)`` with 2 groups; the
``tiny-hybrid`` preset ``(0, 3, 2, 0)`` with attention at layer 1; a hybrid with a Mamba-2 prelude and coda,
sandwich norms, an MLP and dense injection) are exported by ``looplm export hf`` (``config.json`` says
``LoopLMForCausalLM``; the plugin's config class names the Mamba form) and served by vLLM's offline ``LLM``
with vLLM's defaults. Checked against looplm on the same weights, as ``test_plugin_exact.py`` checks the
attention models: greedy tokens equal ``generate``'s for 16 prompts, prompt and generated log-probabilities
within 1e-4, the 16 prompts together equal each alone; a prompt cut into chunks of 24 tokens (chunked prefill:
each chunk starts from the state the last one left) gives the same; the ``shared`` KV policy equals looplm's
``kv_shared`` cache (attention slots shared across loops, one SSM state per (loop, layer)); at tensor-parallel
size 2 (8 prompts; the pure model's 2 groups split over the ranks, the hybrid's one group repeated on each) the
same. Prefix caching, asked for, is turned off (``looplm.vllm.mamba_config``): 5 prompts of 130–340 tokens
sharing a 300-token prefix — with it on, vLLM's CPU build raises ``IndexError`` in its Mamba-2 layer — give
looplm's tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_plugin_exact import N_NEW, PROMPTS, TOL, _max_diff, _reference, assert_matches, table_row  # noqa: E402
from tiny import MAMBA_VARIANTS, serve_runs, write_tiny  # noqa: E402

EXACT = list(MAMBA_VARIANTS)
PREFIX = "hybrid-loop/prefix-caching"


def _long_prompts() -> list[list[int]]:
    """5 prompts sharing a 300-token prefix: full 128-token blocks for vLLM's prefix cache to reuse."""
    import torch

    g = torch.Generator().manual_seed(3)
    base = [257] + torch.randint(0, 256, (299,), generator=g).tolist()
    tails = [base + torch.randint(0, 256, (k,), generator=g).tolist() for k in (5, 40, 1)]
    return tails + [base[:130], base[:256]]


CHUNKED = "hybrid-prelude-coda/chunked"
SHARED = "hybrid-loop/shared"


def serve_all(root: Path):
    """Write the models, looplm's references, serve them with vLLM (one subprocess): ``(refs, runs by name)``."""
    runs, refs = [], {}
    for name in EXACT:
        model, d = write_tiny(name, root / name)
        refs[name] = _reference(model, PROMPTS, N_NEW)
        runs.append(
            {
                "name": name,
                "dir": str(d),
                "prompts": PROMPTS,
                "max_tokens": N_NEW,
                "alone": True,
            }
        )
        if name == "hybrid-prelude-coda":  # chunked prefill: at most 24 scheduled tokens per step
            refs[CHUNKED] = refs[name]
            runs.append(
                {
                    "name": CHUNKED,
                    "dir": str(d),
                    "prompts": PROMPTS,
                    "max_tokens": N_NEW,
                    "llm_kwargs": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
                }
            )
        if name == "hybrid-loop":
            # the shared KV policy: looplm's kv_shared (attention slots shared across loops, SSM states per loop)
            refs[SHARED] = _reference(model, PROMPTS, N_NEW, kv_shared=True)
            runs.append(
                {
                    "name": SHARED,
                    "dir": str(d),
                    "prompts": PROMPTS,
                    "max_tokens": N_NEW,
                    "hf_overrides": {"looplm_kv_policy": "shared"},
                }
            )
            # prefix caching asked for: turned off (vLLM's CPU build fails on its Mamba-2 checkpoints)
            long = _long_prompts()
            refs[PREFIX] = _reference(model, long, 4)
            runs.append(
                {
                    "name": PREFIX,
                    "dir": str(d),
                    "prompts": long,
                    "max_tokens": 4,
                    "llm_kwargs": {"enable_prefix_caching": True},
                }
            )
    res = serve_runs(root, runs, kv_gib="1", timeout=900)
    return refs, {r["name"]: r for r in res["runs"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return serve_all(tmp_path_factory.mktemp("vllm-mamba"))


def _served(served, name):
    refs, runs = served
    run = runs[name]
    assert "error" not in run, f"{name} did not load in vLLM: {run['error']}"
    assert run["remote_modules"] == [], f"{name}: vLLM imported code from the model directory"
    return refs[name], run


@pytest.mark.parametrize("name", [*EXACT, CHUNKED, SHARED, PREFIX])
def test_greedy_and_logprobs_equal_looplm(served, name):
    ref, run = _served(served, name)
    assert_matches(ref, run["together"], name)


def test_shared_policy_differs_from_per_loop_here(served):
    """The shared run above equals looplm's kv_shared; it must also differ from per-loop slots, or the test
    could not tell the policies apart."""
    refs, _ = served
    shared, per_loop = refs[SHARED], refs["hybrid-loop"]
    assert any(r["tokens"] != p["tokens"] for r, p in zip(shared, per_loop)) or any(
        _max_diff(r["logprobs"], p["logprobs"]) > TOL for r, p in zip(shared, per_loop)
    )


@pytest.mark.parametrize("name", EXACT)
def test_concurrent_equal_alone(served, name):
    _, run = _served(served, name)
    assert len(run["together"]) == len(run["alone"]) == len(PROMPTS) == 16
    for i, (t, a) in enumerate(zip(run["together"], run["alone"])):
        assert t["tokens"] == a["tokens"], f"{name}, prompt {i}: batched differs from alone"
        assert _max_diff(t["logprobs"], a["logprobs"]) <= TOL
        assert _max_diff(t["prompt_logprobs"], a["prompt_logprobs"]) <= TOL


TP_NAMES = ("mamba2-loop", "hybrid-loop")  # 2 groups: one per rank; 1 group: on every rank (vLLM repeats it)


@pytest.fixture(scope="module")
def served_tp(tmp_path_factory):
    """``TP_NAMES`` at tensor-parallel size 2 (two spawned workers, one core each), 8 prompts: ``(refs, runs)``."""
    root = tmp_path_factory.mktemp("vllm-mamba-tp")
    runs, refs = [], {}
    for name in TP_NAMES:
        model, d = write_tiny(name, root / name)
        refs[name] = _reference(model, PROMPTS[:8], N_NEW)
        runs.append(
            {
                "name": name,
                "dir": str(d),
                "prompts": PROMPTS[:8],
                "max_tokens": N_NEW,
                "tensor_parallel_size": 2,
            }
        )
    res = serve_runs(root, runs, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, kv_gib="1", timeout=900)
    return refs, {r["name"]: r for r in res["runs"]}


@pytest.mark.parametrize("name", TP_NAMES)
def test_tensor_parallel_equals_looplm(served_tp, name):
    ref, run = _served(served_tp, name)
    assert run["tensor_parallel_size"] == 2
    assert_matches(ref, run["together"], f"{name} at TP 2")


if __name__ == "__main__":  # the Mamba rows of docs/vllm.md's exactness table: python tests_vllm/test_mamba.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        refs, runs = serve_all(Path(tmp))
    for name, ref in refs.items():
        print(f"{table_row(name, ref, runs[name])} {runs[name]['seconds']} s |")
