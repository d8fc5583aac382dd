"""looplm's vLLM plugin at ``--pipeline-parallel-size 2`` on vLLM's CPU build (docs/vllm.md, issue 61).

A looped core runs whole on one pipeline rank (each loop feeds the next); the stages split between the prelude's
blocks, the core and the coda's blocks (``looplm.vllm.stages``), and vLLM hands each rank's ``hidden_states`` and
the embeddings ``embeds`` to the next. Two tiny random models (``tiny.PP_VARIANTS``) are served by vLLM's offline
``LLM`` at PP 2 (two spawned workers, one core each: ``VLLM_CPU_OMP_THREADS_BIND='0|1'``):

* CoreLoop ``(1, 2, 3, 1)`` with dense injection: rank 0 runs the prelude, rank 1 the core (whose rule reads
  the embeddings E, sent from rank 0) and the coda;
* Qwen3 ``(0, 2, 3, 1)`` whose rule normalises between loops with the final norm ``N`` (``inter_norm``): rank 0
  runs the core (with ``N``, which every rank holds), rank 1 the coda and the tied head (its embedding loaded
  there).

Checked: the greedy tokens equal looplm ``generate``'s for 8 prompts submitted together, and the prompt and
generated log-probabilities are within 1e-4 of looplm's. vLLM's CPU runner allocates the buffers a later pipeline
rank receives into only in its warm-up, which it skips with ``enforce_eager=True`` (a stock Llama at PP 2 stops
with ``AssertionError`` in ``sync_and_gather_intermediate_tensors`` then): these runs leave the compilation mode
on. The plugin's model is not compiled by it (not a ``support_torch_compile`` class); only the warm-up runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_plugin_exact import _prompts, _reference, assert_matches  # noqa: E402
from tiny import PP_VARIANTS, serve_named, write_tiny  # noqa: E402

PROMPTS = _prompts(8, seed=3)
N_NEW = 8
PP2 = {"pipeline_parallel_size": 2, "enforce_eager": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pp")
    refs, runs = {}, []
    for name in PP_VARIANTS:
        model, d = write_tiny(name, root / name)
        refs[name] = _reference(model, PROMPTS, N_NEW)  # asserts generate's tokens too
        runs.append({"name": name, "dir": str(d), "prompts": PROMPTS, "max_tokens": N_NEW, "llm_kwargs": PP2})
    runs = serve_named(root, runs, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    return refs, runs


@pytest.mark.parametrize("name", list(PP_VARIANTS))
def test_pp2_equals_looplm(served, name):
    refs, runs = served
    run = runs[name]
    assert "error" not in run, f"{name} at PP 2: {run['error']}"
    assert run["pipeline_parallel_size"] == 2
    assert_matches(refs[name], run["together"], f"{name} at PP 2")
