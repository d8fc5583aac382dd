"""looplm's vLLM plugin against looplm, in fp32 on vLLM's CPU build (``make test-vllm``; docs/vllm.md).

Tiny random models (``tiny.py``) are written as vLLM serves them — looplm's export, or Ouro's / Huginn's
original format — and served by vLLM's offline ``LLM`` through the plugin (``serve_tiny.py``, one subprocess
for the module). Checked against looplm on the same weights:

* greedy tokens equal ``model.generate``'s (Ouro / Huginn: the model looplm's import reads from the directory);
* the generated tokens' and the prompt's log-probabilities are within 1e-4 of looplm's;
* 16 prompts of different lengths submitted together equal each prompt submitted alone;
* the ``shared`` KV policy equals looplm's ``kv_shared`` cache (StateLoop's attention mixer's slot too);
* a design the plugin cannot serve (a hybrid Mamba-2 model with per-token exit; ``test_mamba.py`` serves
  Mamba-2 designs) is refused when the model loads, by name and reason;
* no code from a model directory is imported (no ``--trust-remote-code``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import VARIANTS, serve_runs, write_tiny  # noqa: E402

from looplm.hf.public import load_public  # noqa: E402

HERE = Path(__file__).parent
EXACT = [n for n in VARIANTS if n != "tiny-hybrid"]
ORIGINAL = {"ouro", "huginn"}
SHARED = ("tiny-coreloop", "stateloop-attn")
N_NEW = 8
TOL = 1e-4


def _prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 40, (n,), generator=g).tolist()
    return [[257] + torch.randint(0, 256, (k - 1,), generator=g).tolist() for k in lens]


PROMPTS = _prompts()


@torch.no_grad()
def _reference(model, prompts, n: int, kv_shared: bool = False) -> list[dict]:
    """looplm's greedy decode of each prompt alone: tokens, their logprobs, the prompt's logprobs."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        full = model(ids).logits[0].double().log_softmax(-1)  # [T, V]
        prompt_lp = [None] + [float(full[i - 1, t]) for i, t in enumerate(p) if i > 0]
        cache = model.new_cache(1, capacity=len(p) + n, kv_shared=kv_shared)
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        toks, lps = [], []
        for _ in range(n):
            lp = logits[0, -1].double().log_softmax(-1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
            logits = model(torch.tensor([[t]]), cache=cache, logits_to_keep=1).logits
        if not kv_shared:  # the incremental loop above is looplm's generate
            assert model.generate(ids, max_new_tokens=n)[0, len(p) :].tolist() == toks
        out.append({"tokens": toks, "logprobs": lps, "prompt_logprobs": prompt_lp})
    return out


def serve_all(root: Path):
    """Write every model under ``root``, compute looplm's references, serve them all with vLLM (one subprocess):
    ``(references, vLLM runs by name, the whole vLLM result)``."""
    runs, refs = [], {}
    for name in EXACT:
        fmt = "original" if name in ORIGINAL else "looplm"
        model, d = write_tiny(name, root / name, fmt=fmt)
        if fmt == "original":
            model = load_public(d)[0].float().eval()  # looplm's import of the directory is the reference
        refs[name] = _reference(model, PROMPTS, N_NEW)
        runs.append({"name": name, "dir": str(d), "prompts": PROMPTS, "max_tokens": N_NEW, "alone": True})
        if name in SHARED:  # the shared KV policy: the blocks' slots, and the rule attention's (stateloop-attn)
            refs[f"{name}/shared"] = _reference(model, PROMPTS, N_NEW, kv_shared=True)
            runs.append(
                {
                    "name": f"{name}/shared",
                    "dir": str(d),
                    "prompts": PROMPTS,
                    "max_tokens": N_NEW,
                    "hf_overrides": {"looplm_kv_policy": "shared"},
                }
            )
    _, d = write_tiny("tiny-hybrid", root / "tiny-hybrid")
    exit = {"looplm_exit": {"criterion": "convergence", "threshold": 0.5}}
    runs.append({"name": "tiny-hybrid", "dir": str(d), "prompts": PROMPTS[:1], "max_tokens": 2, "hf_overrides": exit})
    res = serve_runs(root, runs, kv_gib="2", timeout=900)
    return refs, {r["name"]: r for r in res["runs"]}, res


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return serve_all(tmp_path_factory.mktemp("vllm-plugin"))


def _served(served, name):
    refs, runs, _ = served
    run = runs[name]
    assert "error" not in run, f"{name} did not load in vLLM: {run['error']}"
    return refs[name], run


def _max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b) if x is not None and y is not None)


def assert_matches(ref: list, together: list, label: str) -> None:
    """vLLM's runs of the prompts (``together``) against looplm's (``ref``, :func:`_reference`): the same greedy
    tokens, prompt and generated log-probabilities within ``TOL``."""
    for i, (r, v) in enumerate(zip(ref, together, strict=True)):
        assert v["tokens"] == r["tokens"], f"{label}, prompt {i}: tokens differ from looplm"
        assert _max_diff(r["prompt_logprobs"], v["prompt_logprobs"]) <= TOL, f"{label}, prompt {i}: prompt logprobs"
        assert _max_diff(r["logprobs"], v["logprobs"]) <= TOL, f"{label}, prompt {i}: generated logprobs"


def table_row(name: str, ref: list, run: dict) -> str:
    """``| name | tokens equal | prompt logprobs diff | generated logprobs diff | batched = alone |`` of a run."""
    tog = run["together"]
    same = sum(r["tokens"] == v["tokens"] for r, v in zip(ref, tog))
    dp = max(_max_diff(r["prompt_logprobs"], v["prompt_logprobs"]) for r, v in zip(ref, tog))
    dg = max(_max_diff(r["logprobs"], v["logprobs"]) for r, v in zip(ref, tog) if r["tokens"] == v["tokens"])
    alone = "—" if "alone" not in run else f"{sum(t['tokens'] == a['tokens'] for t, a in zip(tog, run['alone']))}/16"
    return f"| {name} | {same}/{len(ref)} | {dp:.1e} | {dg:.1e} | {alone} |"


def test_registered_and_no_remote_code(served):
    _, runs, res = served
    assert res["registered"] == {"LoopLMForCausalLM": True, "OuroForCausalLM": True, "RavenForCausalLM": True}
    for name, run in runs.items():
        assert run["remote_modules"] == [], f"{name}: vLLM imported code from the model directory"


@pytest.mark.parametrize("name", EXACT)
def test_greedy_equals_looplm(served, name):
    ref, run = _served(served, name)
    for i, (r, v) in enumerate(zip(ref, run["together"])):
        assert v["tokens"] == r["tokens"], f"{name}, prompt {i} (length {len(PROMPTS[i])})"


@pytest.mark.parametrize("name", EXACT)
def test_logprobs_within_tolerance(served, name):
    ref, run = _served(served, name)
    for i, (r, v) in enumerate(zip(ref, run["together"])):
        assert len(v["prompt_logprobs"]) == len(PROMPTS[i])
        assert _max_diff(r["prompt_logprobs"], v["prompt_logprobs"]) <= TOL, f"{name}, prompt {i}: prompt logprobs"
        if v["tokens"] == r["tokens"]:
            assert _max_diff(r["logprobs"], v["logprobs"]) <= TOL, f"{name}, prompt {i}: generated logprobs"


@pytest.mark.parametrize("name", EXACT)
def test_concurrent_equal_alone(served, name):
    _, run = _served(served, name)
    assert len(run["together"]) == len(run["alone"]) == len(PROMPTS) == 16
    for i, (t, a) in enumerate(zip(run["together"], run["alone"])):
        assert t["tokens"] == a["tokens"], f"{name}, prompt {i}: batched differs from alone"
        assert _max_diff(t["logprobs"], a["logprobs"]) <= TOL
        assert _max_diff(t["prompt_logprobs"], a["prompt_logprobs"]) <= TOL


@pytest.mark.parametrize("name", SHARED)
def test_shared_kv_policy_equals_looplm_kv_shared(served, name):
    ref, run = _served(served, f"{name}/shared")
    per_loop = served[0][name]
    assert any(r["tokens"] != p["tokens"] for r, p in zip(ref, per_loop)) or any(
        _max_diff(r["logprobs"], p["logprobs"]) > TOL for r, p in zip(ref, per_loop)
    ), "the shared policy must differ from per-loop slots here, or this test cannot tell them apart"
    for i, (r, v) in enumerate(zip(ref, run["together"])):
        assert v["tokens"] == r["tokens"], f"prompt {i}"
        assert _max_diff(r["logprobs"], v["logprobs"]) <= TOL


def test_mamba_design_refused_at_load(served):
    _, runs, _ = served
    err = runs["tiny-hybrid"].get("error")
    assert err is not None, "a hybrid Mamba-2 model was served with per-token exit"
    assert "cannot serve 'tiny-hybrid'" in err and "per-token exit (looplm_exit) with Mamba-2 blocks" in err, err


if __name__ == "__main__":  # the exactness table of docs/vllm.md: python tests_vllm/test_plugin_exact.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        refs, runs, _ = serve_all(Path(tmp))
    print(
        "| model | greedy tokens equal | max abs diff, prompt logprobs | max abs diff, generated logprobs "
        "| batched = alone (tokens) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, ref in refs.items():
        print(table_row(name, ref, runs[name]))
