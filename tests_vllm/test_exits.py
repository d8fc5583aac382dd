"""Per-token exit inside vLLM (docs/vllm.md#exits) against looplm's ``generate(exit=...)``, fp32, CPU build.

The config field ``looplm_exit`` (here through ``hf_overrides``) sets a server-wide criterion; decode tokens
stop looping when it holds, the loops they skip run only their attention call, which writes each skipped slot
with the key and value of the exit loop (looplm's ``copy``) or of the stand-in ``Z^{r+1}`` (``propagate``); prompt
tokens run every loop (``prefill='full'``). Three tiny random models, each criterion once, at a threshold where
the tokens' depths differ:

* ``tiny-coreloop`` (prelude, coda, 1 KV head) with ``convergence``, ``copy`` and ``propagate``;
* ``timestep-adaln`` (per-loop block modulation) with ``kl``, ``copy``;
* ``exit-gate-sandwich`` with ``gate``, ``copy`` and ``propagate``.

Checked: the greedy tokens of 8 prompts served together, and of each served alone (a step whose only token
exits early: the skipped slots still get their fill), equal each prompt's looplm ``generate`` with the same
``Exit(criterion, threshold, kv)``, and differ from full depth somewhere (the exits and fills matter), and
``propagate``'s from ``copy``'s (tiny-coreloop);
the loops vLLM ran for the decode tokens equal looplm's executed depths, and are fewer than full depth's; a
server with prefix caching or chunked prefill on is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_plugin_exact import _prompts  # noqa: E402
from tiny import serve_named, write_tiny  # noqa: E402

from looplm.decode.exits import Exit  # noqa: E402

HERE = Path(__file__).parent
PROMPTS = _prompts(8, seed=2)
N_NEW = 8
CASES = {  # run -> (model, criterion, threshold, kv): thresholds where the random models' depths differ per token
    "tiny-coreloop": ("tiny-coreloop", "convergence", 0.6, "copy"),
    "timestep-adaln": ("timestep-adaln", "kl", 0.55, "copy"),
    "exit-gate-sandwich": ("exit-gate-sandwich", "gate", 0.2, "copy"),
    "tiny-coreloop/propagate": ("tiny-coreloop", "convergence", 0.6, "propagate"),
    "exit-gate-sandwich/propagate": ("exit-gate-sandwich", "gate", 0.2, "propagate"),
}
NO_SHARING = {"enable_prefix_caching": False, "enable_chunked_prefill": False}


@torch.no_grad()
def _looplm(model, crit: str, t: float, kv: str = "copy") -> tuple[list, list, int]:
    """Each prompt alone: tokens with the exit, tokens at full depth, the core loops its decode tokens ran."""
    toks, full, loops = [], [], 0
    for p in PROMPTS:
        ids = torch.tensor([p])
        out, st = model.generate(
            ids, max_new_tokens=N_NEW, exit=Exit(criterion=crit, threshold=t, kv=kv), return_stats=True
        )
        toks.append(out[0, len(p) :].tolist())
        full.append(model.generate(ids, max_new_tokens=N_NEW)[0, len(p) :].tolist())
        loops += int(sum(int(e.sum()) for e in st.executed))
    return toks, full, loops


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-exits")
    refs, runs = {}, []
    for name, (variant, crit, t, kv) in CASES.items():
        d = root / variant
        model, _ = write_tiny(variant, d)
        refs[name] = _looplm(model, crit, t, kv)
        exit_cfg = {"looplm_exit": {"criterion": crit, "threshold": t, "kv": kv}}
        runs.append(
            {
                "name": name,
                "dir": str(d),
                "prompts": PROMPTS,
                "max_tokens": N_NEW,
                "hf_overrides": exit_cfg,
                "llm_kwargs": NO_SHARING,
                "exit_stats": True,
                "alone": True,
            }
        )
    first = next(iter(CASES))
    runs.append(  # prefix caching left on: refused
        {
            "name": "prefix-caching",
            "dir": str(root / first),
            "prompts": PROMPTS[:1],
            "max_tokens": 2,
            "hf_overrides": {"looplm_exit": {"criterion": "convergence", "threshold": 0.6}},
        }
    )
    runs = serve_named(root, runs)
    return refs, runs


@pytest.mark.parametrize("name", list(CASES))
def test_exits_equal_looplm_generate(served, name):
    refs, runs = served
    toks, full, loops = refs[name]
    run = runs[name]
    assert "error" not in run, f"{name}: {run['error']}"
    assert toks != full, f"{name}: the exits change no token here; pick a threshold where they do"
    for i, (r, v) in enumerate(zip(toks, run["together"], strict=True)):
        assert v["tokens"] == r, f"{name}, prompt {i} (length {len(PROMPTS[i])}): vLLM with exits differs from looplm"
    R = 3
    st = run["exit_stats"]
    assert st["decode_tokens"] == len(PROMPTS) * (N_NEW - 1)
    assert st["executed_loops"] == loops < R * st["decode_tokens"], st


@pytest.mark.parametrize("name", list(CASES))
def test_exits_of_a_request_alone_equal_looplm_generate(served, name):
    """Each prompt served by itself: a decode step of one token that exits leaves no token looping, and the
    loops it skipped still get their fill (the step's later attention calls run for the fill alone)."""
    refs, runs = served
    toks = refs[name][0]
    for i, (r, v) in enumerate(zip(toks, runs[name]["alone"], strict=True)):
        assert v["tokens"] == r, f"{name}, prompt {i} alone: vLLM with exits differs from looplm"


def test_propagate_differs_from_copy(served):
    refs, _ = served  # (the gate model's tokens happen to agree under both fills)
    assert refs["tiny-coreloop"][0] != refs["tiny-coreloop/propagate"][0], "propagate's fill changes no token here"


def test_exits_refuse_prefix_caching(served):
    err = served[1]["prefix-caching"].get("error", "")
    assert "prefix caching" in err and "enable_prefix_caching=False" in err, err
