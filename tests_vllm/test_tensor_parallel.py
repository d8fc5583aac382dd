"""looplm's vLLM plugin at ``--tensor-parallel-size 2`` on vLLM's CPU build (docs/vllm.md, issue 61).

vLLM's parallel layers shard the heads, the MLP and the vocabulary over the ranks and all-reduce after every
``RowParallelLinear``, so each rank holds the whole hidden state and runs looplm's rule modules replicated.
Tiny random models with 4 query and 2 KV heads (``tiny.TP_VARIANTS``: CoreLoop with a prelude and a coda, a
rule with parameters — timestep AdaLN —, QK-norm + tied head + dense injection, and StateLoop's attention
mixer, whose heads stay whole on each rank) are served by vLLM's
offline ``LLM`` at TP 1 (in-process) and at TP 2 (two spawned workers, one core each:
``VLLM_CPU_OMP_THREADS_BIND='0|1'``), in one subprocess (``serve_tiny.py``). Checked:

* TP 2's greedy tokens equal TP 1's and looplm ``generate``'s, for every prompt submitted together;
* TP 2's prompt and generated log-probabilities are within 1e-4 of looplm's;
* per-token exit (``looplm_exit``, convergence) at TP 2 equals looplm's ``generate(exit=...)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_exits  # noqa: E402
from test_plugin_exact import _prompts, _reference, assert_matches  # noqa: E402
from tiny import TP_VARIANTS, serve_named, write_tiny  # noqa: E402

HERE = Path(__file__).parent
PROMPTS = _prompts(8, seed=1)
N_NEW = 8
EXIT = ("convergence", 0.6)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-tp")
    refs, runs = {}, []
    for name in TP_VARIANTS:
        model, d = write_tiny(name, root / name)
        refs[name] = _reference(model, PROMPTS, N_NEW)  # asserts generate's tokens too
        for tp in (1, 2):
            runs.append(
                {
                    "name": f"{name}/tp{tp}",
                    "dir": str(d),
                    "prompts": PROMPTS,
                    "max_tokens": N_NEW,
                    "tensor_parallel_size": tp,
                }
            )
        if name == "tp-coreloop":  # per-token exit, each rank running the exit path on its heads
            refs["exit"] = test_exits._looplm(model, *EXIT)
            runs.append(
                {
                    "name": "tp-coreloop/tp2-exit",
                    "dir": str(d),
                    "prompts": test_exits.PROMPTS,
                    "max_tokens": test_exits.N_NEW,
                    "tensor_parallel_size": 2,
                    "hf_overrides": {"looplm_exit": {"criterion": EXIT[0], "threshold": EXIT[1]}},
                    "llm_kwargs": test_exits.NO_SHARING,
                }
            )
    # one core per rank; the TP 1 runs use the in-process executor, which does not read the bind
    runs = serve_named(root, runs, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    return refs, runs


@pytest.mark.parametrize("name", list(TP_VARIANTS))
def test_tp2_equals_tp1_and_looplm(served, name):
    refs, runs = served
    tp1, tp2 = runs[f"{name}/tp1"], runs[f"{name}/tp2"]
    assert "error" not in tp1, f"{name} at TP 1: {tp1['error']}"
    assert "error" not in tp2, f"{name} at TP 2: {tp2['error']}"
    assert (tp1["tensor_parallel_size"], tp2["tensor_parallel_size"]) == (1, 2)
    for i, (r, a, b) in enumerate(zip(refs[name], tp1["together"], tp2["together"], strict=True)):
        assert a["tokens"] == r["tokens"], f"{name}, prompt {i}: TP 1 differs from looplm"
        assert b["tokens"] == a["tokens"], f"{name}, prompt {i}: TP 2 differs from TP 1"
    assert_matches(refs[name], tp2["together"], f"{name} at TP 2")


def test_tp2_exits_equal_looplm(served):
    refs, runs = served
    run = runs["tp-coreloop/tp2-exit"]
    assert "error" not in run, run["error"]
    assert run["tensor_parallel_size"] == 2
    toks, full, _ = refs["exit"]
    assert toks != full, "the exits change no token here; pick a threshold where they do"
    for i, (r, v) in enumerate(zip(toks, run["together"], strict=True)):
        assert v["tokens"] == r, f"prompt {i}: TP 2 with exits differs from looplm generate(exit=...)"
