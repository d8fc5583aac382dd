"""Per-request exit thresholds inside vLLM (docs/vllm.md#per-request-thresholds) against looplm, fp32, CPU build.

The server sets the criterion (``looplm_exit``) and runs the plugin's logits processor
(``logits_processors=["looplm.vllm.processor:RequestExitThresholds"]``); each request sets its own threshold in
``SamplingParams.extra_args["looplm_exit"]`` (a number ε, ``0`` or ``"none"``: full depth; absent: the
server's). Two tiny random models, requests with different thresholds served in one batch:

* ``tiny-coreloop`` with ``convergence`` (server ε = 0.6), at most 3 requests running at once and different
  ``max_tokens``: requests finish at different steps, later ones take the freed rows and vLLM condenses its
  batch (the processor's removed / added / moved bookkeeping is exercised);
* ``timestep-adaln`` with ``kl`` (server ε = 0.55), all 8 requests at once.

Checked: each request's greedy tokens equal looplm ``generate(exit=Exit(criterion, its threshold))`` of its
prompt alone; the thresholds matter (some request's tokens differ from what the server's threshold gives it,
and the loops its decode tokens run differ between thresholds); the core loops vLLM ran for the decode tokens
equal the sum of looplm's executed depths; bad values are refused with ``VLLMValidationError`` naming the
value, before any forward; the processor on a server without ``looplm_exit``, or with the ``gate`` criterion,
is refused when the model loads. And the processor as vLLM's classes call it (admission, ``BatchUpdate`` with
vLLM's move kinds, untouched logits, a model that is not looplm's refused), without serving.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_plugin_exact import _prompts  # noqa: E402
from tiny import serve_named, write_tiny  # noqa: E402

from looplm.decode.exits import Exit  # noqa: E402

PROMPTS = _prompts(8, seed=2)
PROC = "looplm.vllm.processor:RequestExitThresholds"
NO_SHARING = {"enable_prefix_caching": False, "enable_chunked_prefill": False, "logits_processors": [PROC]}
R = 3  # the tiny models' loops
# run -> (model, criterion, server threshold, each request's extra_args value (None: unset), max_tokens, more LLM kwargs)
CASES = {
    "tiny-coreloop": (
        "tiny-coreloop",
        "convergence",
        0.6,
        [None, "none", 0.8, 0, 1.0, 0.6, 0.45, 0.8],
        [8, 5, 8, 3, 6, 8, 4, 7],
        {"max_num_seqs": 3},
    ),
    "timestep-adaln": ("timestep-adaln", "kl", 0.55, [None, "none", 0.8, 0, 0.4, 0.55, 0.8, None], 8, {}),
}
BAD = [-0.5, math.nan, math.inf, "fast", "0.01", True, [0.1]]  # each refused (vllm_xargs carries no dicts)


def _eps(v, server: float) -> float:
    return server if v is None else 0.0 if v in ("none", 0) else float(v)


@torch.no_grad()
def _looplm(model, crit: str, server: float, values, max_tokens) -> dict:
    """Per prompt alone: tokens at its threshold, tokens at the server's, its decode tokens' core loops."""
    toks, at_server, loops = [], [], []
    for p, v, n in zip(PROMPTS, values, max_tokens):
        ids = torch.tensor([p])
        out, st = model.generate(
            ids, max_new_tokens=n, exit=Exit(criterion=crit, threshold=_eps(v, server)), return_stats=True
        )
        toks.append(out[0, len(p) :].tolist())
        at_server.append(
            model.generate(ids, max_new_tokens=n, exit=Exit(criterion=crit, threshold=server))[0, len(p) :].tolist()
        )
        loops.append(int(sum(int(e.sum()) for e in st.executed)))
    return {"tokens": toks, "at_server": at_server, "loops": loops}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-thresholds")
    refs, runs = {}, []
    for name, (variant, crit, t, values, mt, kw) in CASES.items():
        d = root / variant
        model, _ = write_tiny(variant, d)
        mt = mt if isinstance(mt, list) else [mt] * len(PROMPTS)
        refs[name] = _looplm(model, crit, t, values, mt)
        runs.append(
            {
                "name": name,
                "dir": str(d),
                "prompts": PROMPTS,
                "max_tokens": mt,
                "extra_args": [None if v is None else {"looplm_exit": v} for v in values],
                "hf_overrides": {"looplm_exit": {"criterion": crit, "threshold": t}},
                "llm_kwargs": {**NO_SHARING, **kw},
                "exit_stats": True,
                "refused": [{"looplm_exit": v} for v in BAD] + [{"looplm_exits": 0.1}]
                if name == "tiny-coreloop"
                else [],
            }
        )
    write_tiny("exit-gate-sandwich", root / "exit-gate-sandwich")
    for name, d, exit_cfg in (  # the processor on a server it cannot serve: refused at load
        ("no-exit", root / "tiny-coreloop", None),
        ("gate", root / "exit-gate-sandwich", {"looplm_exit": {"criterion": "gate", "threshold": 0.2}}),
    ):
        runs.append(
            {
                "name": name,
                "dir": str(d),
                "prompts": PROMPTS[:1],
                "max_tokens": 2,
                "hf_overrides": exit_cfg,
                "llm_kwargs": NO_SHARING,
            }
        )
    runs = serve_named(root, runs)
    return refs, runs


@pytest.mark.parametrize("name", list(CASES))
def test_each_request_runs_its_own_threshold(served, name):
    refs, runs = served
    _, _, _, values, _, _ = CASES[name]
    ref, run = refs[name], runs[name]
    assert "error" not in run, f"{name}: {run['error']}"
    for i, (want, got) in enumerate(zip(ref["tokens"], run["together"], strict=True)):
        assert got["tokens"] == want, f"{name}, prompt {i}, looplm_exit={values[i]!r}: vLLM differs from looplm"
    assert ref["tokens"] != ref["at_server"], f"{name}: no request's threshold changes its tokens; pick others"
    per_token = {}  # threshold -> core loops per decode token (looplm's)
    for v, n, got in zip(values, ref["loops"], run["together"]):
        per_token.setdefault(_eps(v, CASES[name][2]), []).append(n / (len(got["tokens"]) - 1))
    assert all(x == R for x in per_token[0.0]), per_token  # 'none' and 0: full depth
    assert min(min(x) for x in per_token.values()) < R, per_token
    st = run["exit_stats"]
    assert st["decode_tokens"] == sum(len(g["tokens"]) - 1 for g in run["together"])
    assert st["executed_loops"] == sum(ref["loops"]) < R * st["decode_tokens"], st
    if name == "tiny-coreloop":  # requests left the batch and vLLM condensed it: the moves were followed
        u = st["row_updates"]
        assert u["added"] >= len(PROMPTS) and u["removed"] > 0 and u["moved"] > 0, u


def test_bad_thresholds_are_refused_before_any_work(served):
    run = served[1]["tiny-coreloop"]
    for v, err in zip(BAD + ["looplm_exits"], run["refused"], strict=True):
        assert err is not None and err.startswith("VLLMValidationError"), (v, err)
        assert "looplm_exit" in err and (repr(v) in err or v == "looplm_exits"), err
    assert run["exit_stats_after_refused"]["forwards"] == run["exit_stats"]["forwards"]  # none reached the model


def test_processor_refused_where_it_cannot_apply(served):
    runs = served[1]
    err = runs["no-exit"].get("error", "")
    assert "runs full depth" in err and "looplm_exit" in err and PROC in err, err
    err = runs["gate"].get("error", "")
    assert "gate criterion" in err and "q=0.2" in err and PROC in err, err


def test_processor_in_vllm_classes():
    """The processor as vLLM's own code calls it: admission (``validate_logits_processors_parameters``, which
    the front end runs per request), a ``BatchUpdate`` with vLLM's move kinds, the untouched logits, and the
    refusal of a model that is not looplm's."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality, validate_logits_processors_parameters

    from looplm.vllm.processor import RequestExitThresholds
    from looplm.vllm.thresholds import installed

    validate_logits_processors_parameters([PROC], SamplingParams(extra_args={"looplm_exit": 0.01}))
    validate_logits_processors_parameters([PROC], SamplingParams(extra_args={"looplm_exit": "none"}))
    with pytest.raises(VLLMValidationError, match="looplm_exit=-1 is not a finite number"):
        validate_logits_processors_parameters([PROC], SamplingParams(extra_args={"looplm_exit": -1}))

    def config(arch):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch])))

    with pytest.raises(ValueError, match=r"this model's architectures are \['LlamaForCausalLM'\]"):
        RequestExitThresholds(config("LlamaForCausalLM"), torch.device("cpu"), False)
    p = RequestExitThresholds(config("LoopLMForCausalLM"), torch.device("cpu"), False)
    assert installed() is p.rows and p.is_argmax_invariant()
    sp = [SamplingParams(extra_args=x) for x in ({"looplm_exit": 0.3}, None, {"looplm_exit": "none"})]
    p.update_state(BatchUpdate(3, [], [(i, s, [1], []) for i, s in enumerate(sp)], []))
    p.update_state(None)
    p.update_state(BatchUpdate(2, [1], [], [(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert p.rows.values(2, 9.0) == [0.3, 0.0]
    p.update_state(BatchUpdate(2, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    assert p.rows.values(2, 9.0) == [0.0, 0.3]
    logits = torch.randn(2, 7)
    assert p.apply(logits) is logits
