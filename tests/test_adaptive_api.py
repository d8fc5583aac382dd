"""Adaptive depth through the interfaces: `looplm generate --exit / --speculative`, the lm-eval model's
generate_until, and `looplm eval threshold`'s decoding with the loops skipped."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.cli import main
from looplm.data.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


def test_cli_generate_with_exit_and_speculative(capsys):
    base = ["generate", "--model", "tiny-llama", "--prompt", "The loop ", "--max-new-tokens", "8"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative", "2", "--draft-k", "3"]) == 0
    assert capsys.readouterr().out == plain  # lossless
    assert main(base + ["--speculative", "2", "--draft-exit", "convergence:0.5"]) == 0
    assert capsys.readouterr().out == plain  # a draft whose depth an exit criterion picks: lossless too
    assert main(base + ["--exit", "convergence:0.9", "--kv-policy", "propagate", "--min-loops", "2", "--stats"]) == 0
    cap = capsys.readouterr()
    stats = json.loads(cap.err.strip().splitlines()[-1])
    assert stats["tokens"] == 7 and 2 <= stats["executed_depth"] <= 3 and stats["max_loops"] == 3


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--exit", "gate:0.5"], "needs a rule with a learned exit gate"),
        (["--exit", "kl:-1"], "threshold ε"),
        (["--speculative", "3"], r"draft_loops must be an int in \[1, 2\]"),
        (["--kv-policy", "copy"], "are options of --exit"),
        (["--exit", "kl:1e-3", "--max-loops", "0"], "max_loops must be an int >= 1"),
        (["--draft-exit", "kl:1e-3"], "give --speculative R_D"),
        (["--speculative", "2", "--draft-exit", "replay:1"], "as draft_loops"),
    ],
)
def test_cli_generate_refuses_bad_adaptive_options(extra, match, capsys):
    assert main(["generate", "--model", "tiny-llama", "--max-new-tokens", "4", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and __import__("re").search(match, err), err


@pytest.mark.parametrize(
    "mask,match",
    [
        ([[1, 1, 1, 1], [1, 1, 1, 0]], r"row\(s\) \[1\] are right-padded.*left-pad"),
        ([[1, 1, 1, 1], [0, 0, 0, 0]], r"row\(s\) \[1\] are all 0"),
        ([[1, 1, 1, 1], [0, 1, 0, 1]], r"row\(s\) \[1\] are right-padded"),
        ([[1, 1, 1, 2], [1, 1, 1, 1]], r"0 \(padding\) and 1 \(token\) only"),
    ],
)
@pytest.mark.parametrize("how", [{}, {"exit": "kl:0.01"}, {"speculative": 1}])
def test_generate_refuses_a_mask_it_cannot_decode(mask, match, how):
    """A right-padded row decoded other tokens than the row alone; an all-zero row was accepted."""
    from helpers import assert_refused_before_any_work

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (2, 4))
    assert_refused_before_any_work(m, lambda: m.generate(x, 4, attention_mask=torch.tensor(mask), **how), match)
    left = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # left padding decodes as the row alone
    assert torch.equal(m.generate(x, 4, attention_mask=left, **how)[1, 1:], m.generate(x[1:, 1:], 4, **how)[0])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_loops": 193}, r"num_loops=193 is more than 64x the model's trained K = 3"),
        ({"num_loops": torch.tensor([1, 10**5])}, "num_loops=100000"),
        ({"exit": {"criterion": "kl", "threshold": 0.0, "max_loops": 10**8}}, "max_loops=100000000"),
        ({"exit": "replay:99"}, r"replay depth 99 exceeds the model's trained K = 3"),
        ({"exit": {"criterion": "replay", "depths": torch.tensor([1, 4])}}, "replay depth 4 exceeds"),
        ({"exit": {"criterion": "replay", "depths": 5, "max_loops": 4}}, "replay depth 5 exceeds max_loops = 4"),
    ],
)
def test_generate_refuses_runaway_depths_unless_asked(kw, match):
    from helpers import assert_refused_before_any_work

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (2, 3))
    assert_refused_before_any_work(m, lambda: m.generate(x, 2, **kw), match)
    assert m.generate(x, 1, num_loops=192).shape == (2, 4)  # 64 x K itself runs
    assert m.generate(x, 1, num_loops=200, allow_deep=True).shape == (2, 4)
    assert m.generate(x, 1, exit={"criterion": "kl", "threshold": 0.5, "max_loops": 200}, allow_deep=True).shape == (
        2,
        4,
    )


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--loops", "100000"], "num_loops=100000 .*--allow-deep"),
        (["--exit", "kl:0", "--max-loops", "100000000"], "max_loops=100000000 .*--allow-deep"),
        (["--exit", "replay:99"], "replay depth 99 exceeds the model's trained K = 3"),
        (["--speculative", "1", "--draft-k", "600"], "= 600 is more than the 500"),
        (["--speculative", "1", "--draft-k", "1000000"], "= 1000000 is more than the 500"),
    ],
)
def test_cli_generate_refuses_runaway_work(extra, match, capsys):
    assert main(["generate", "--model", "tiny-llama", "--max-new-tokens", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and __import__("re").search(match, err), err


def test_cli_generate_runs_deep_when_asked(capsys):
    assert main(["generate", "--model", "tiny-llama", "--max-new-tokens", "2", "--loops", "200", "--allow-deep"]) == 0
    assert (
        main(["generate", "--model", "tiny-llama", "--max-new-tokens", "2", "--exit", "replay:5", "--max-loops", "5"])
        == 0
    )


class _Req:  # an lm-eval Instance as generate_until reads it: args = (context, generation kwargs)
    def __init__(self, *args):
        self.args = args


def _alone(m, prompt: str, n: int, exit: dict) -> str:
    """``prompt`` decoded alone by looplm's own ``generate`` under ``exit``, cut at eos, as text."""
    ids = torch.tensor([TOK.encode(prompt)])
    ref = m.generate(ids, n, eos_token_id=TOK.eos_id, exit=exit)[0, ids.shape[1] :].tolist()
    return TOK.decode(ref[: ref.index(TOK.eos_id)] if TOK.eos_id in ref else ref)


def test_lm_eval_generate_until_takes_exit_and_speculative_options():
    pytest.importorskip("lm_eval")
    from looplm.eval.harness import LoopLMEvalModel

    torch.manual_seed(0)
    m = looplm.build("tiny-coreloop", max_seq_len=128).eval()
    prompts = ["Q: what loops?\nA:", "x", "The model said"]
    reqs = [_Req(p, {"until": [], "max_gen_toks": 10}) for p in prompts]
    plain = LoopLMEvalModel(model=m, tokenizer=TOK, batch_size=3).generate_until(reqs)
    spec = LoopLMEvalModel(model=m, tokenizer=TOK, batch_size=3, speculative="1", draft_k="3").generate_until(reqs)
    assert spec == plain
    spec = LoopLMEvalModel(model=m, tokenizer=TOK, batch_size=3, speculative="2", draft_exit="kl:0.01").generate_until(
        reqs
    )
    assert spec == plain
    lm = LoopLMEvalModel(model=m, tokenizer=TOK, batch_size=1, exit="replay:2", kv_policy="propagate")
    got = lm.generate_until(reqs)
    for p, text in zip(prompts, got):  # exactly looplm's own adaptive decoding
        assert text == _alone(m, p, 10, {"criterion": "replay", "depths": 2, "kv": "propagate"})
    with pytest.raises(ValueError, match="kv policy 'nope'"):
        LoopLMEvalModel(model=m, tokenizer=TOK, exit="kl:1e-3", kv_policy="nope")
    with pytest.raises(ValueError, match="not both"):
        LoopLMEvalModel(model=m, tokenizer=TOK, exit="kl:1e-3", speculative="1")
    with pytest.raises(ValueError, match="are options of --exit"):  # a policy without an exit is not silently dropped
        LoopLMEvalModel(model=m, tokenizer=TOK, kv_policy="copy")


def test_lm_eval_generate_until_refills_rows_under_the_depth_schedule(monkeypatch):
    """exit_schedule='depth': a group of requests runs through batch_size rows (request refill), and each
    text equals the whole group decoded at once (max_batch=None) and the prompt decoded alone."""
    pytest.importorskip("lm_eval")
    from looplm.decode.depth_schedule import DepthBatchedDecoder
    from looplm.eval.harness import LoopLMEvalModel

    torch.manual_seed(0)
    m = looplm.build("tiny-llama", max_seq_len=128).eval()
    prompts = ["Q: what loops?\nA:", "x", "The model said", "ab", "Once upon a time", "zz top"]
    gen = {"until": [], "max_gen_toks": 9}
    reqs = [_Req(p, gen) for p in prompts]
    refills, real = [], DepthBatchedDecoder._refill
    monkeypatch.setattr(DepthBatchedDecoder, "_refill", lambda self, *a, **k: refills.append(1) or real(self, *a, **k))
    lm = LoopLMEvalModel(model=m, tokenizer=TOK, batch_size=2, exit="replay:2", kv_policy="copy", exit_schedule="depth")
    assert lm.decode_options["exit"].max_batch == 2
    got = lm.generate_until(reqs)
    assert refills  # the queue really went through the rows
    for p, text in zip(prompts, got):
        assert text == _alone(m, p, 9, {"criterion": "replay", "depths": 2, "kv": "copy"}), p
    refills.clear()
    whole = LoopLMEvalModel(
        model=m, tokenizer=TOK, batch_size=len(prompts), exit="replay:2", kv_policy="copy", exit_schedule="depth"
    ).generate_until(reqs)
    assert whole == got and not refills  # one batch of 6 rows: nothing queued


def test_threshold_sweep_decodes_with_the_loops_skipped():
    """`eval threshold`'s decoding: q = 1 runs every loop; with kv='full' the decoding's PPL is the output
    selection's (the paper's semantics) on the same positions; with kv='copy' fewer loops run."""
    from looplm.eval.threshold import decode_sweep, format_sweep, lm_metric, sweep

    torch.manual_seed(0)
    m = looplm.build("tiny-hybrid", n_loops=4, overrides={"rule": {"name": "exit_gate"}}).eval()
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)
        m.rule.gate.bias.zero_()
    batch = torch.randint(0, 260, (2, 20))
    rows = sweep(m, lm_metric([batch]), thresholds=(0.5, 1.0), fixed_loops=[2])
    decode_sweep(m, batch, rows, kv="full")
    q5, q1, r2 = rows
    assert q1["decode_executed_depth"] == 4 and r2["decode_executed_depth"] == 4  # kv='full' runs every loop
    with torch.no_grad():
        sel = m(batch, loop_options={"exit_threshold": 0.5}).logits[:, 8:-1]
    nll = F.cross_entropy(sel.reshape(-1, sel.shape[-1]), batch[:, 9:].reshape(-1))
    assert q5["decode_ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    decode_sweep(m, batch, rows, kv="copy")
    assert q5["decode_executed_depth"] < 4 and r2["decode_executed_depth"] == 2 and q1["decode_executed_depth"] == 4
    table = format_sweep(rows)
    assert "| time / full |" in table and "| threshold | 0.50 |" in table
    assert all(r["decode_time_ratio"] > 0 for r in rows)


def test_bench_helpers_measure_what_they_say():
    """`looplm bench adaptive`'s pieces on a tiny model: KV bytes per policy (shared = per-loop ÷ K), the
    interleaved decode timing, and teacher-forced quality (kv='full' agrees with full depth exactly)."""
    from looplm.decode.token_schedule import AdaptiveDecoder
    from looplm.bench.adaptive import FullDepth, decode_timing, kv_bytes_per_token, teacher_forced_quality

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    per_loop = kv_bytes_per_token(m, "copy")
    assert per_loop == 3 * 2 * 2 * (2 * 16) * 4  # K loops x layers x (k, v) x H_kv·hd x fp32 bytes
    assert kv_bytes_per_token(m, "shared") == per_loop / 3
    res = decode_timing(
        m,
        torch.randint(0, 260, (2, 4)),
        3,
        {
            "full": lambda b, c: FullDepth(m, b, c),
            "r1": lambda b, c: AdaptiveDecoder(m, b, c, {"criterion": "replay", "depths": 1}),
        },
        runs=1,
    )
    assert res["full"]["ratio"] == 1.0 and res["r1"]["stats"]["executed_depth"] == 1.0 and res["r1"]["ms_per_token"] > 0
    ids = torch.randint(0, 260, (2, 12))
    q = teacher_forced_quality(m, ids, {"criterion": "replay", "depths": 1, "kv": "full"}, prompt_len=4)
    assert q["executed_depth"] == 3 and q["selected_depth"] == 1 and q["agreement"] < 1
    full = teacher_forced_quality(m, ids, {"criterion": "convergence", "threshold": 0.0}, prompt_len=4)
    assert (
        full["agreement"] == 1.0
        and full["kl_to_full"] < 1e-6
        and full["ppl"] == pytest.approx(full["ppl_full"], rel=1e-5)
    )


def test_bench_speculative_timing_reports_phases_and_the_free_verification_bound():
    """The speculative row's timing: full and speculative whole generate calls alternated; the draft and
    verification seconds come from the run's statistics, and the free-verification bound (full time over
    the speculative time less its verifications) is above the measured speed-up."""
    from looplm.bench.adaptive import _speculative_times

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    prompts = torch.randint(0, 260, (1, 5))
    res = _speculative_times(m, prompts, 8, {"draft_loops": 1, "k": 2}, 2, "wall")
    st = res["stats"]
    assert res["identical"] and len(res["speedups"]) == 2 and res["full_s"] > 0
    assert st["draft_ms_per_round"] > 0 and st["verify_ms_per_round"] > 0
    assert res["bound"] > res["speedup"] > 0
    assert "reclaim_gain" not in res


def test_bench_speculative_compares_reclaimed_and_kept_draft_columns():
    """`--compare-reclaim`: the run keeping rejected drafts' columns is timed in the same alternation, is
    lossless too, and its cache is the longer one (T + (n + 1)(k + 1) against T + n + 2(k + 1) columns)."""
    from looplm.bench.adaptive import TABLES, _md, section_speculative

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    ids, prompts = torch.randint(0, 260, (2, 12)), {2: torch.randint(0, 260, (2, 5))}
    (row,) = section_speculative(m, ids, prompts, [1], [3], 12, 1, "wall", [torch.float32], compare_reclaim=True)
    assert row["greedy_identical"]
    assert row["keep_columns"] == 5 + 13 * 4 and row["cache_columns"] == 5 + 12 + 2 * 4
    assert row["peak_columns"] <= row["cache_columns"] and row["reclaim_gain"] > 0 and row["speedup_keep"] > 0
    table = _md([row], TABLES["reclaim"]).splitlines()
    assert len(table) == 3 and "| 57 | 25 |" in table[2]


def test_bench_speculative_section_rows_for_fixed_and_exit_drafts():
    """One row per (r_d, k) and per draft exit (at most the largest r_d loops), each lossless, with its draft
    depth and the loop verification resumed at."""
    from looplm.bench.adaptive import section_speculative

    torch.manual_seed(0)
    m = looplm.build("tiny-llama", n_loops=5).eval()
    ids, prompts = torch.randint(0, 260, (2, 12)), {1: torch.randint(0, 260, (1, 5))}
    rows = section_speculative(m, ids, prompts, [1, 4], [2], 6, 1, "wall", [torch.float32], exits=["convergence:0.8"])
    assert [(r["draft_loops"], r["draft_exit"]) for r in rows] == [(1, "-"), (4, "-"), (4, "convergence:0.8")]
    assert all(r["greedy_identical"] for r in rows)
    assert rows[0]["mean_draft_depth"] == 1 and rows[0]["verify_start"] == 2
    assert 2 <= rows[2]["mean_draft_depth"] <= 4 and rows[2]["verify_start"] <= rows[2]["mean_draft_depth"] + 1
    assert rows[2]["draft_agreement"] is None  # (teacher-forced agreement is a fixed depth's)


def test_bench_scale_section_times_the_schedules_on_attention_and_mamba2_backbones():
    """The scale section's rows: one per mixer, batch and schedule asked for (the static schedule beside the
    depth schedule at batch > 1), each with its executed depth and time ratio against full depth."""
    from looplm.bench.adaptive import _contenders, section_scale

    m = looplm.build("tiny-llama").eval()
    assert set(_contenders(m, 2, {"r": {"kv": "copy"}}, ("depth", "static"))) == {
        "full",
        "r/token",
        "r/depth",
        "r/static",
    }
    assert set(_contenders(m, 1, {"r": {"kv": "copy"}}, ("depth", "static"))) == {
        "full",
        "r/token",
    }  # batch 1: one schedule
    rows = section_scale(
        torch.tensor([1, 2, 4]), [64], (2,), 4, 1, "wall", [torch.float32], ("token", "static"), ("attention", "mamba2")
    )
    assert [(r["mixer"], r["schedule"]) for r in rows] == [
        ("attention", "token"),
        ("attention", "static"),
        ("mamba2", "token"),
        ("mamba2", "static"),
    ]
    assert all(0 < r["executed_ratio"] < 1 and r["time_ratio"] > 0 for r in rows)


def test_bench_timing_compares_carried_and_at_exit_propagate_fills():
    """`--compare-carry`: each kv=propagate setting also runs with its fills written at the exit, in the same
    alternation, under each schedule; the decoders it times carry (or not) and both decode."""
    from looplm.bench.adaptive import _contenders, section_timing

    torch.manual_seed(0)
    m = looplm.build("tiny-llama").eval()
    specs = {
        "p": {"criterion": "kl", "threshold": 0.5, "kv": "propagate"},
        "c": {"criterion": "kl", "threshold": 0.5, "kv": "copy"},
    }
    cont = _contenders(m, 2, specs, ("token", "depth"), at_exit=True)
    assert set(cont) == {"full", "p/token", "p/depth", "p/token-at-exit", "p/depth-at-exit", "c/token", "c/depth"}
    assert cont["p/token"](2, 8).carry_fills and not cont["p/token-at-exit"](2, 8).carry_fills
    assert not cont["p/depth-at-exit"](2, 8).carry_fills
    prompts = {2: torch.randint(0, 260, (2, 5))}
    rows = section_timing(m, prompts, [("kl", 0.5, "propagate")], 6, 1, "wall", [torch.float32], compare_carry=True)
    assert [r["schedule"] for r in rows] == ["token", "depth", "token-at-exit", "depth-at-exit"]
    assert all(r["time_ratio"] > 0 and 0 < r["executed_ratio"] <= 1 for r in rows)


def test_bench_prefill_section_times_the_forward_against_the_plain_one_and_token_by_token():
    """`--sections prefill`: each setting's exit forward beside the plain forward (time, executed / computed
    ratio, PPL) and the same exits scored token by token, whose logits it equals."""
    from looplm.bench.adaptive import TABLES, _md, section_prefill

    torch.manual_seed(0)
    m = looplm.build("tiny-llama", n_loops=5).eval()
    ids = torch.randint(0, 260, (2, 12))
    rows = section_prefill(m, ids, [("kl", 0.003, "copy"), ("convergence", 0.0, "copy")], 1, "wall", [torch.float32])
    assert [(r["criterion"], r["kv"]) for r in rows] == [("kl", "copy"), ("convergence", "copy")]
    assert all(r["max_logit_diff"] < 1e-5 and r["time_ratio"] > 0 and r["sequential_ms"] > 0 for r in rows)
    assert rows[0]["executed_ratio"] < 1 and rows[1]["executed_ratio"] == 1  # ε = 0: every loop
    assert rows[1]["ppl"] == pytest.approx(rows[1]["ppl_full"], rel=1e-5)
    assert "vs token by token" in _md(rows, TABLES["prefill"])


def test_lm_eval_model_refuses_runaway_loops_unless_asked():
    pytest.importorskip("lm_eval")
    from looplm.eval.harness import LoopLMEvalModel

    torch.manual_seed(0)
    m = looplm.build("tiny-llama", max_seq_len=64).eval()
    with pytest.raises(
        ValueError, match=r"loops \(--loops\)=100000 is more than 64x the model's trained K = 3 .*--allow-deep"
    ):
        LoopLMEvalModel(model=m, tokenizer=TOK, loops=100000)
    with pytest.raises(ValueError, match="max_loops=100000 is more than 64x"):
        LoopLMEvalModel(model=m, tokenizer=TOK, exit="kl:0", max_loops="100000")
    assert LoopLMEvalModel(model=m, tokenizer=TOK, loops=200, allow_deep="true").loops == 200
