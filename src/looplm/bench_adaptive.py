"""``looplm bench adaptive``: what per-token exit and self-speculative decoding really save (issue #23).

Every number is measured against full-depth decoding *in the same process*, on models trained here:

* ``lm`` — a looped Transformer (2 shared blocks × K = 4, d = 256) trained on a corpus with a random loop
  count per step (``configs/bench/adaptive-lm.yaml``); zero-shot exit criteria (``kl``, ``convergence``)
  and the r_d-loop self-speculative draft;
* ``phop`` — p-hop (n = 32, p = 4) on a 1⊗4 looped Transformer with the two-stage exit gate (stage 1
  by ``looplm task phop train configs/bench/adaptive-phop-gate.yaml``, stage 2 here): the ``gate``
  criterion.

Tables (``--sections``, each a list of dicts in the JSON written to ``--out``):

* ``quality`` — teacher-forced decoding of held-out text with exits: selected and executed depth, fill
  and check FLOPs, greedy agreement with full depth and ``KL(full ‖ adaptive)`` of the next-token
  distributions, per criterion threshold and KV policy; PPL;
* ``timing`` — decode-only wall (and CPU) time per generated token, adaptive vs full depth, on the same
  prompts, at batch 1 and 8, fp32 and bf16, on the fused CPU path: the wall-time ratio beside the
  executed-depth ratio and the target ``ratio <= 1.1 × executed / K``; at batch 8 under both schedules
  (``token``: rows wait for the batch's deepest; ``depth``: continuous depth batching, :mod:`looplm.decode.depth_schedule`),
  the contenders then interleaved generation by generation (rows are at different tokens), else token by token;
* ``kv_bytes`` — KV-cache bytes per token per policy;
* ``speculative`` — the draft's agreement with full depth, accepted tokens per round, speed-up of
  greedy self-speculative decoding over full depth at batch 1 and 8;
* ``task`` — p-hop accuracy vs selected / executed depth vs wall time over the gate's q (and fixed depths);
* ``scale`` — the timing protocol on larger backbones (random weights, the LM's measured exit depths
  replayed), showing where fixed per-token costs stop hiding the saving;
* ``prefill`` — per-token exit in one forward (:mod:`looplm.decode.exit_forward`: a prompt, a scored text) on
  held-out text at batch 8 against the plain forward: wall-time ratio beside the executed and computed
  ratio, PPL; and against scoring the same exits token by token (its speed-up, the largest logit difference).

``--train`` (re)trains the models into ``--runs`` (default ``runs/adaptive-bench``; trained weights stay
out of git). Plots: ``--png-dir`` (accuracy / PPL vs executed depth, annotated with the time ratio).

    looplm bench adaptive --train --data /work/shared/data/tinyshakespeare.txt
    looplm bench adaptive --sections timing,speculative --clock cpu --threads 1 --json
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from .eval.decode_timing import FullDepth, _now, decode_timing, decoded_nll, teacher_forced_timing  # noqa: F401

__all__ = ["FullDepth", "decode_timing", "register", "teacher_forced_quality", "teacher_forced_timing"]

SECTIONS = ("quality", "frontier", "timing", "kv_bytes", "speculative", "task", "scale", "prefill")


@torch.inference_mode()
def teacher_forced_quality(model, ids: torch.Tensor, exit, prompt_len: int = 8, ref_logits: torch.Tensor | None = None) -> dict:
    """Score ``ids [B, T]`` token by token with exits (:meth:`AdaptiveDecoder.score`) against full depth:
    greedy agreement and ``KL(full ‖ adaptive)`` of every decoded position, PPL of both, the depth summary."""
    from .decode.token_schedule import AdaptiveDecoder

    if ref_logits is None:
        ref_logits = model(ids).logits.float()
    dec = AdaptiveDecoder(model, ids.shape[0], ids.shape[1], exit)
    got = dec.score(ids, prompt_len)
    a, r = got[:, prompt_len:-1].float(), ref_logits[:, prompt_len:-1].float()  # positions decoded one at a time
    tgt = ids[:, prompt_len + 1 :]
    la, lr = F.log_softmax(a, -1), F.log_softmax(r, -1)
    kl = (lr.exp() * (lr - la)).sum(-1)  # KL(full ‖ adaptive)
    nll = F.nll_loss(la.reshape(-1, la.shape[-1]), tgt.reshape(-1))
    nll_full = F.nll_loss(lr.reshape(-1, lr.shape[-1]), tgt.reshape(-1))
    return {
        "agreement": float((a.argmax(-1) == r.argmax(-1)).float().mean()), "kl_to_full": float(kl.mean()),
        "ppl": math.exp(float(nll)), "ppl_full": math.exp(float(nll_full)), **dec.stats.summary(),
    }  # fmt: skip


def kv_bytes_per_token(model, kv: str, batch: int = 1) -> float:
    """KV-cache bytes one token occupies (every attention slot of every loop; ``shared``: one per layer)."""
    from .decode.token_schedule import AdaptiveDecoder

    dec = AdaptiveDecoder(model, batch, 4, {"criterion": "replay", "depths": 1, "kv": kv})
    with torch.no_grad():
        dec(torch.zeros(batch, 2, dtype=torch.long))
    total = 0
    for s in dec.cache.physical_slots():
        k = getattr(s, "_k", None)
        if k is not None:
            total += 2 * k.numel() * k.element_size() // k.shape[2]  # one column of keys and values
    return total / batch


# ------------------------------------------------------------------------------------------------
# models trained here
# ------------------------------------------------------------------------------------------------


def _repo_file(rel: str) -> Path:
    from .train.cli import find_config

    return find_config(rel)


LM_CONFIG = "configs/bench/adaptive-lm.yaml"


def train_lm(runs: Path, data: str, steps: int | None = None, config: str = LM_CONFIG) -> Path:
    from .train.config import load_train_config
    from .train.trainer import Trainer

    out = runs / "lm"
    ov = [f"data.paths=[{data}]"] + ([f"train.max_steps={steps}"] if steps else [])
    Trainer(load_train_config(_repo_file(config), ov), out, resume=True, quiet=True).fit()
    return out


def load_lm(runs: Path, device="cpu"):
    from .checkpoint_io import load_model_for_inference

    model, tok = load_model_for_inference(runs / "lm", device=device)
    return model.eval(), tok


def train_phop(runs: Path, stage1_steps: int = 1000, stage2_steps: int = 400, quiet: bool = True) -> Path:
    """The base (final-loop loss, the task trainer), then the exit gate's stage 1 and stage 2 (App. B)."""
    from .tasks.train import load_task_config, train_task

    cfg = load_task_config(_repo_file("configs/bench/adaptive-phop-gate.yaml"), task="phop")
    base = runs / "phop-base"
    if not (base / "results.json").exists():
        train_task(cfg, base, quiet=quiet)
    s1 = gate_stage(base, runs / "phop-gate1", stage=1, steps=stage1_steps, lr=1e-3)
    return gate_stage(s1, runs / "phop-gate2", stage=2, steps=stage2_steps, lr=3e-3)


def gate_stage(run: Path, out: Path, stage: int, steps: int, lr: float, seed: int = 1) -> Path:
    """Continue a task run with the exit gate (App. B): ``stage`` 1 trains every parameter on the
    entropy-regularised expected loss (β = 0.25) from the run's weights (a new gate, bias −2); stage 2 only
    ``rule.gate`` on the improvement-target BCE (κ = 50, γ = 0.005), everything else frozen. AdamW, cosine
    to 0.1 of ``lr``; writes a task run (``model.safetensors``, ``config.json``) at ``out``."""
    from safetensors.torch import load_file, save_file

    from .dataclass_util import to_dict
    from .tasks.train import build_task_model, load_task_run

    if (out / "model.safetensors").exists():
        return out
    _, cfg = load_task_run(run)
    d = Path(run)
    if (d / "results.json").exists() and not (d / "model.safetensors").exists():
        d = d / f"seed_{json.loads((d / 'results.json').read_text())['best_seed']}"
    cfg.model_overrides = {**cfg.model_overrides, "rule": {"name": "exit_gate", "options": {"stage": stage, "beta": 0.25, "bias_init": -2.0}}}
    torch.manual_seed(seed)
    model = build_task_model(cfg)
    missing, _ = model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
    assert set(missing) <= {"rule.gate.weight", "rule.gate.bias"}, missing
    model.train()
    params = [p for n, p in model.named_parameters() if stage == 1 or n.startswith("rule.gate")]
    for n, p in model.named_parameters():
        p.requires_grad_(stage == 1 or n.startswith("rule.gate"))
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    stream = cfg.task.stream(seed)
    for _ in range(steps):
        ids, labels = stream.next_batch(cfg.train.batch_size)
        model(ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"task_run": to_dict(cfg), "model": to_dict(model.config), "seed": seed}, indent=2))
    return out


# ------------------------------------------------------------------------------------------------
# the sections
# ------------------------------------------------------------------------------------------------


def _held_out(tok, data: str, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """``[n, length]`` rows of the LM's validation documents (every 50th speech of the corpus, never trained
    on), ``seed`` picking which of the first ``4n`` rows."""
    from .data.config import DataConfig
    from .data.pipeline import iter_val_batches

    if not Path(data).exists():
        raise FileNotFoundError(f"--data {data!r}: the LM's corpus is not there (a text file; the LM trains on it)")
    cfg = DataConfig(source="files", paths=[data], split_mode="blank_lines", seq_len=length, tokenizer="byte", shuffle_buffer=0)
    rows = torch.cat(list(iter_val_batches(cfg, tok, None, 64)))[: 4 * n]
    g = torch.Generator().manual_seed(seed)
    return rows[torch.randperm(rows.shape[0], generator=g)[:n]]


def section_quality(model, ids, settings, policies, prompt_len: int = 8) -> list[dict]:
    with torch.no_grad():
        ref = model(ids).logits.float()
    rows = []
    for crit, eps in settings:
        for kv in policies:
            r = teacher_forced_quality(model, ids, {"criterion": crit, "threshold": eps, "kv": kv}, prompt_len, ref)
            rows.append({"criterion": crit, "threshold": eps, "kv": kv, **r})
    return rows


def section_frontier(model, ids, settings, kv: str, runs: int, clock: str, prompt_len: int = 8) -> list[dict]:
    """PPL vs executed depth vs time: every setting decodes the held-out rows token by token (teacher forcing)
    interleaved with full depth on the same tokens; PPL of the decoded positions, executed depth, time ratio."""
    from .decode.token_schedule import AdaptiveDecoder

    cont = {"full": lambda b, c: FullDepth(model, b, c)}
    for crit, eps in settings:
        spec = {"criterion": crit, "threshold": eps, "kv": kv}
        cont[(crit, eps)] = lambda b, c, spec=spec: AdaptiveDecoder(model, b, c, spec)
    res = teacher_forced_timing(model, ids, cont, prompt_len=prompt_len, runs=runs, clock=clock)
    rows = []
    for key, r in res.items():
        nll = decoded_nll(r["logits"], ids, prompt_len)
        st = r["stats"] or {"executed_depth": model.config.n_loops, "selected_depth": model.config.n_loops}
        crit, eps = ("full", None) if key == "full" else key
        rows.append({"criterion": crit, "threshold": eps, "kv": kv if key != "full" else "-", "ppl": math.exp(nll),
                     "executed_depth": st["executed_depth"], "selected_depth": st["selected_depth"],
                     "ms_per_token": r["ms_per_token"], "time_ratio": r["ratio"], "clock": clock})  # fmt: skip
    return rows


@torch.inference_mode()
def section_prefill(model, ids, settings, runs: int, clock: str, dtypes, sequential: bool = True) -> list[dict]:
    """Per-token exit in one forward (:func:`looplm.decode.exit_forward.adaptive_forward`, every token after the
    first) against the plain forward of the same text, interleaved run by run (rotating order, medians): wall
    time, executed and computed ratio (the packs' padding included), PPL of every position's next token. With
    ``sequential`` the same exits are also scored token by token (:meth:`AdaptiveDecoder.score`, the
    reference; one run): its time and the largest logit difference to the forward's (``max_logit_diff``)."""
    from .decode.token_schedule import AdaptiveDecoder
    from .decode.exit_forward import adaptive_forward
    from .eval.decode_timing import _rotated

    now = _now(clock)
    B, T = ids.shape
    tgt = ids[:, 1:]
    nll = lambda lg: float(F.cross_entropy(lg[:, :-1].float().reshape(-1, lg.shape[-1]), tgt.reshape(-1)))  # noqa: E731
    rows = []
    for dt in dtypes:
        m = model.to(dt)
        specs = {(c, e, kv): {"criterion": c, "threshold": e, "kv": kv} for c, e, kv in settings}
        calls = {"full": lambda: m(ids).logits}
        calls.update({k: (lambda spec=spec: adaptive_forward(m, ids, spec, full_depth_prefix=1)) for k, spec in specs.items()})
        per_run = {k: [] for k in calls}
        last = {}
        for run in range(runs + 1):  # the first run warms up
            for k in _rotated(list(calls), run):
                t0 = now()
                last[k] = calls[k]()
                if run:
                    per_run[k].append(now() - t0)
        full_s = statistics.median(per_run["full"])
        ppl_full = math.exp(nll(last["full"]))
        for k, spec in specs.items():
            out = last[k]
            st = out.stats
            row = {"dtype": str(dt).replace("torch.", ""), "batch": B, "tokens": T, "criterion": k[0], "threshold": k[1], "kv": k[2],
                   "selected_depth": st["selected_depth"], "executed_ratio": st["executed_ratio"],
                   "computed_ratio": st["computed_ratio"], "ppl": math.exp(nll(out.logits)), "ppl_full": ppl_full,
                   "full_ms": 1000 * full_s, "ms": 1000 * statistics.median(per_run[k]),
                   "time_ratio": statistics.median([a / b for a, b in zip(per_run[k], per_run["full"])]), "clock": clock}  # fmt: skip
            row["target_met"] = row["time_ratio"] <= 1.1 * row["executed_ratio"]
            if sequential:
                dec = AdaptiveDecoder(m, B, T, spec)
                t0 = now()
                ref = dec.score(ids, 1)
                row["sequential_ms"] = 1000 * (now() - t0)
                row["speedup_vs_sequential"] = row["sequential_ms"] / row["ms"]
                row["max_logit_diff"] = float((ref[:, 1:] - out.logits[:, 1:].float()).abs().max())
            rows.append(row)
    model.float()
    return rows


def _at_exit(dec):
    """``dec`` with its ``kv='propagate'`` fills written at the exit, not carried into the next core pass
    (:mod:`looplm.decode.kv_fill`): the run ``--compare-carry`` times beside the carrying one."""
    dec.carry_fills = False
    return dec


BATCH_SCHEDULES = ("depth", "static", "static-compiled")  # beside 'token', at batch > 1


def _contenders(m, B: int, specs: dict, schedules=("token", "depth"), at_exit: bool = False) -> dict:
    """``{"full": ..., name: decoder factory}`` for :func:`decode_timing` / :func:`generation_timing`: each spec
    (an exit) under the token schedule, and at batch > 1 also under the depth schedule (continuous depth
    batching; at batch 1 the two are one schedule) and, when asked, its fixed-shape form ``static`` (and that
    form with its pass through torch.compile, ``static-compiled``)."""
    from .decode.token_schedule import AdaptiveDecoder
    from .decode.depth_schedule import DepthBatchedDecoder
    from .decode.static_schedule import StaticDepthDecoder

    cont = {"full": lambda b, c: FullDepth(m, b, c)}
    classes = {"token": AdaptiveDecoder, "depth": DepthBatchedDecoder, "static": StaticDepthDecoder}
    for name, spec in specs.items():
        batched = [s for s in BATCH_SCHEDULES if s in schedules] if B > 1 and spec["kv"] != "full" else []
        for sched in ["token"] + batched:
            opts = {"schedule": sched.removesuffix("-compiled"), **({"compile": True} if sched == "static-compiled" else {})}
            cont[f"{name}/{sched}"] = lambda b, c, spec=spec, opts=opts: classes[opts["schedule"]](
                m, b, c, spec if opts["schedule"] == "token" else {**spec, **opts})
        if at_exit and spec["kv"] == "propagate":  # the same decoders with the fills written at the exit
            for sched in ["token"] + [s for s in batched if s == "depth"]:  # (static refuses propagate)
                cont[f"{name}/{sched}-at-exit"] = lambda b, c, make=cont[f"{name}/{sched}"]: _at_exit(make(b, c))
    return cont


def _timed(m, prompts, new_tokens, cont, runs, clock) -> dict:
    """Batch 1 and token schedules only: step by step, interleaved token by token (:func:`decode_timing`);
    with a depth-schedule contender (rows at their own tokens): whole generations, interleaved run by run
    (:func:`generation_timing`)."""
    from .eval.decode_timing import generation_timing

    if any(k.rsplit("/", 1)[-1].removesuffix("-at-exit") in BATCH_SCHEDULES for k in cont):
        return generation_timing(m, prompts, new_tokens, cont, runs=runs, clock=clock)
    return decode_timing(m, prompts, new_tokens, cont, runs=runs, clock=clock)


def section_timing(model, prompts_by_batch: dict, settings, new_tokens: int, runs: int, clock: str, dtypes,
                   schedules=("token", "depth"), compare_carry: bool = False) -> list[dict]:
    """Decode time against full depth per setting, batch, dtype and schedule; with ``compare_carry`` each
    ``kv='propagate'`` setting also runs with its fills written at the exit (schedule ``<name>-at-exit``) in
    the same alternation."""
    rows = []
    for dt in dtypes:
        m = model.to(dt)
        for B, prompts in prompts_by_batch.items():
            specs = {f"{crit}:{eps}/{kv}": {"criterion": crit, "threshold": eps, "kv": kv} for crit, eps, kv in settings}
            res = _timed(m, prompts, new_tokens, _contenders(m, B, specs, schedules, compare_carry), runs, clock)
            full_ms = res["full"]["ms_per_token"]
            for name in list(res)[1:]:
                r = res[name]
                crit, eps, kv = next(st for st in settings if name.startswith(f"{st[0]}:{st[1]}/{st[2]}/"))
                ex = r["stats"]["executed_ratio"]
                rows.append({"dtype": str(dt).replace("torch.", ""), "batch": B, "criterion": crit, "threshold": eps, "kv": kv,
                             "schedule": name.rsplit("/", 1)[1],
                             "full_ms_per_token": full_ms, "ms_per_token": r["ms_per_token"], "time_ratio": r["ratio"],
                             "executed_ratio": ex, "selected_depth": r["stats"]["selected_depth"],
                             "executed_depth": r["stats"]["executed_depth"], "batch_depth": r["stats"]["batch_depth"],
                             "flops_ratio": r["stats"]["flops_ratio"], "target_met": r["ratio"] <= 1.1 * ex,
                             "ratios": r["ratios"], "clock": clock})  # fmt: skip
    model.float()
    return rows


@torch.inference_mode()
def _speculative_times(model, prompts, new_tokens, spec, runs, clock, compare_reclaim: bool = False) -> dict:
    """Whole ``generate`` calls, full depth and speculative alternated (their prompts' prefill is the same
    full-depth step in both; the order turns each run). Returns the median ``speedup`` and each run's
    (``speedups``), the round statistics (``stats``), whether the output equals full depth's (``identical``),
    the median full-depth seconds (``full_s``) and the median free-verification ``bound``: the speed-up if
    verification cost nothing, full time over the speculative run's time less its verifications (the drafts,
    the prefill, the bookkeeping). With ``compare_reclaim`` a third contender runs the same speculative
    decoding with ``reclaim=False`` (rejected drafts' columns kept as masked holes) in the same alternation:
    ``speedup_keep`` (full over it), ``reclaim_gain`` (its time over the reclaiming run's, per run, median),
    ``identical_keep`` and its cache columns (``keep_columns``)."""
    from .decode.generate import generate
    from .decode.sampling import decode_context

    now = _now(clock)
    names = ("full", "spec", "keep") if compare_reclaim else ("full", "spec")
    specs = {"spec": spec, "keep": {**spec, "reclaim": False}}
    times = {k: [] for k in names}
    t_rest = []
    with decode_context(model, prompts.shape[0]):
        for run in range(runs + 1):  # run 0 warms up
            outs = {}
            for k in (names if run % 2 == 0 else names[::-1]):
                t0 = now()
                outs[k] = generate(model, prompts, new_tokens) if k == "full" else \
                    generate(model, prompts, new_tokens, speculative=specs[k], return_stats=True)
                dt = now() - t0
                if run:
                    times[k].append(dt)
                    if k == "spec":
                        t_rest.append(dt - outs["spec"][1].verify_s)
    spec_out, st = outs["spec"]
    t_full = times["full"]
    ratios = [f / s for f, s in zip(t_full, times["spec"])]
    res = {"speedup": statistics.median(ratios), "speedups": ratios, "stats": st.summary(),
           "identical": bool(torch.equal(spec_out, outs["full"])), "full_s": statistics.median(t_full),
           "bound": statistics.median(f / r for f, r in zip(t_full, t_rest))}  # fmt: skip
    if compare_reclaim:
        keep_out, keep_st = outs["keep"]
        res.update(speedup_keep=statistics.median(f / s for f, s in zip(t_full, times["keep"])),
                   reclaim_gain=statistics.median(s_keep / s for s_keep, s in zip(times["keep"], times["spec"])),
                   identical_keep=bool(torch.equal(keep_out, outs["full"])), keep_columns=keep_st.capacity)  # fmt: skip
    return res


def section_speculative(model, ids, prompts_by_batch, drafts, ks, new_tokens, runs, clock, dtypes, exits=(),
                        compare_reclaim: bool = False) -> list[dict]:
    """Greedy speculative decoding against full depth: each draft depth ``r_d`` (``drafts``) and tokens per
    round ``k``; with ``exits`` (``'kl:0.01'``, ...) also drafts whose depth that criterion picks, at most
    ``r_d`` loops (their mean draft depth and the loop verification resumed at beside). With
    ``compare_reclaim`` each row also times the run that keeps rejected drafts' columns (``reclaim=False``)."""
    rows = []
    with torch.no_grad():
        full = model(ids).logits.argmax(-1)
        agree = {r: float((model(ids, num_loops=r).logits.argmax(-1) == full).float().mean()) for r in drafts}
    for dt in dtypes:
        m = model.to(dt)
        for B, prompts in prompts_by_batch.items():
            for r, e in [(r, None) for r in drafts] + [(max(drafts), e) for e in exits]:
                for k in ks:
                    spec = {"draft_loops": r, "k": k, "exit": e}
                    res = _speculative_times(m, prompts, new_tokens, spec, runs, clock, compare_reclaim)
                    st, t_full = res["stats"], res["full_s"]
                    rows.append({"dtype": str(dt).replace("torch.", ""), "batch": B, "draft_loops": r, "k": k,
                                 "draft_exit": e or "-", "mean_draft_depth": st.get("mean_draft_depth", float(r)),
                                 "verify_start": st.get("mean_verify_start", r + 1.0),
                                 "draft_agreement": agree[r] if e is None else None, "accepted_per_round": st["accepted_per_round"],
                                 "tokens_per_round": st["tokens_per_round"], "acceptance": st["acceptance"], "speedup": res["speedup"],
                                 "speedups": res["speedups"], "full_ms_per_token": 1000 * t_full / new_tokens,
                                 "draft_ms_per_round": st["draft_ms_per_round"], "verify_ms_per_round": st["verify_ms_per_round"],
                                 "free_verify_bound": res["bound"], "cache_columns": st["cache_columns"],
                                 "peak_columns": st["peak_columns"], "compactions": st["compactions"],
                                 "keep_columns": res.get("keep_columns"), "speedup_keep": res.get("speedup_keep"),
                                 "reclaim_gain": res.get("reclaim_gain"),
                                 "greedy_identical": res["identical"] and res.get("identical_keep", True), "clock": clock})  # fmt: skip
    model.float()
    return rows


@torch.inference_mode()
def section_task(model, cfg, qs, policies, fixed, time_batch: int, runs: int, clock: str, count: int | None = None) -> list[dict]:
    """p-hop accuracy at <ans> under teacher-forced decoding with exits (every token of the sequence decoded
    one at a time, its own exit), next to the full forward; wall time per token at ``time_batch``."""
    from .decode.token_schedule import AdaptiveDecoder

    ids, pos, answers = cfg.task.eval_set()
    if count:
        ids, pos, answers = ids[:count], pos[:count], answers[:count]
    L = int(pos.max()) + 1  # decode up to <ans>
    rows = []
    settings = [("full", None)] + [("gate", q) for q in qs] + [("replay", r) for r in fixed]
    for kv in policies:
        for crit, v in settings:
            if crit == "full" and kv != policies[0]:
                continue
            spec = ({"criterion": "gate", "threshold": 1.0, "kv": "full"} if crit == "full" else
                    {"criterion": crit, ("threshold" if crit == "gate" else "depths"): v, "kv": kv})  # fmt: skip
            correct, sel, ex, sel_ans, ex_ans = 0, [], [], [], []
            for a in range(0, ids.shape[0], 250):
                x, p, y = ids[a : a + 250, :L], pos[a : a + 250], answers[a : a + 250]
                dec = AdaptiveDecoder(model, x.shape[0], L, spec)
                logits = dec.score(x, prompt_len=1)
                correct += int((logits[torch.arange(x.shape[0]), p].argmax(-1) == y).sum())
                s = torch.stack(dec.stats.selected, 1).float()  # [b, L-1]: positions 1 .. L-1
                e = torch.stack(dec.stats.executed, 1).float()
                sel.append(s.mean())
                ex.append(e.mean())
                sel_ans.append(s[torch.arange(x.shape[0]), p - 1].mean())
                ex_ans.append(e[torch.arange(x.shape[0]), p - 1].mean())
            rows.append({"kv": kv if crit != "full" else "-", "setting": crit, "value": v, "accuracy": correct / ids.shape[0],
                         "selected_depth": float(torch.stack(sel).mean()), "executed_depth": float(torch.stack(ex).mean()),
                         "selected_depth_ans": float(torch.stack(sel_ans).mean()),
                         "executed_depth_ans": float(torch.stack(ex_ans).mean())})  # fmt: skip
    # wall time per token at time_batch: every setting of the first policy against full depth, interleaved
    prompts = ids[:time_batch, :8]
    cont = {"full": lambda b, c: FullDepth(model, b, c)}
    for crit, v in settings[1:]:
        spec = {"criterion": crit, ("threshold" if crit == "gate" else "depths"): v, "kv": policies[0]}
        cont[f"{crit}:{v}"] = lambda b, c, spec=spec: AdaptiveDecoder(model, b, c, spec)
    res = decode_timing(model, prompts, L - 8, cont, runs=runs, clock=clock)
    for r in rows:
        if r["kv"] in ("-", policies[0]):
            key = "full" if r["setting"] == "full" else f"{r['setting']}:{r['value']}"
            r["time_ratio"] = res[key]["ratio"]
            r["ms_per_token"] = res[key]["ms_per_token"]
    return rows


def _scale_model(mixer: str, d: int, dt):
    """A random-weight backbone of the scale section: 2 blocks × K = 4 loops at width ``d``, byte vocabulary;
    ``attention`` (Llama blocks, heads of 64) or ``mamba2`` (Mamba-2 blocks, heads of 64, d_state 64)."""
    from .factory import build

    torch.manual_seed(0)
    common = {"d_model": d, "n_core": 2, "n_loops": 4, "vocab_size": 260, "max_seq_len": 1024}
    if mixer == "mamba2":
        return build("tiny-mamba2", overrides={**common, "mamba.headdim": 64, "mamba.d_state": 64, "mamba.ngroups": 1}, dtype=dt).eval()
    return build("tiny-llama", overrides={**common, "d_ff": 3 * d, "attention.n_heads": d // 64, "attention.n_kv_heads": d // 64,
                                          "attention.head_dim": 64}, dtype=dt).eval()  # fmt: skip


def section_scale(depth_pool: torch.Tensor, widths, batches, new_tokens, runs, clock, dtypes, schedules=("token", "depth"),
                  mixers=("attention",)) -> list[dict]:
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
                    rows.append({"mixer": mixer, "d_model": d, "dtype": str(dt).replace("torch.", ""), "batch": B, "schedule": name.rsplit("/", 1)[1],
                                 "executed_ratio": ex, "batch_depth": r["stats"]["batch_depth"], "time_ratio": r["ratio"],
                                 "full_ms_per_token": res["full"]["ms_per_token"], "target_met": r["ratio"] <= 1.1 * ex, "clock": clock})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------
# tables and plots
# ------------------------------------------------------------------------------------------------


def _md(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "| " + " | ".join("---:" if c[2] else "---" for c in cols) + " |"
    lines = [head, sep]
    for r in rows:
        vals = []
        for key, _, fmt in cols:
            v = r.get(key)
            vals.append("" if v is None else (format(v, fmt) if fmt and isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)))
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


TABLES = {
    "quality": [("criterion", "criterion", ""), ("threshold", "ε", "g"), ("kv", "kv", ""), ("selected_depth", "selected", ".2f"),
                ("executed_depth", "executed", ".2f"), ("flops_ratio", "FLOPs / full", ".3f"), ("agreement", "greedy agree", ".3f"),
                ("kl_to_full", "KL(full‖exit)", ".4f"), ("ppl", "PPL", ".3f"), ("ppl_full", "PPL full", ".3f")],
    "timing": [("dtype", "dtype", ""), ("batch", "B", "d"), ("criterion", "criterion", ""), ("threshold", "ε / q", "g"), ("kv", "kv", ""),
               ("schedule", "schedule", ""),
               ("selected_depth", "selected", ".2f"), ("executed_depth", "executed", ".2f"), ("batch_depth", "core passes / step", ".2f"),
               ("executed_ratio", "executed / K", ".3f"), ("time_ratio", "time / full", ".3f"), ("full_ms_per_token", "full ms/tok", ".2f"),
               ("target_met", "≤ 1.1 × executed", "")],
    "frontier": [("criterion", "criterion", ""), ("threshold", "ε", "g"), ("kv", "kv", ""), ("executed_depth", "executed", ".2f"),
                 ("ppl", "PPL", ".3f"), ("ms_per_token", "ms/token", ".2f"), ("time_ratio", "time / full", ".3f")],
    "kv_bytes": [("kv", "policy", ""), ("bytes_per_token", "KV bytes / token", ",.0f"), ("ratio", "vs per-loop", ".3f")],
    "prefill": [("dtype", "dtype", ""), ("batch", "B", "d"), ("tokens", "T", "d"), ("criterion", "criterion", ""),
                ("threshold", "ε", "g"), ("kv", "kv", ""), ("selected_depth", "selected", ".2f"),
                ("executed_ratio", "executed / K", ".3f"), ("computed_ratio", "computed / K", ".3f"), ("ppl", "PPL", ".3f"),
                ("ppl_full", "PPL full", ".3f"), ("full_ms", "full ms", ".1f"), ("ms", "exit ms", ".1f"),
                ("time_ratio", "time / full", ".3f"), ("target_met", "≤ 1.1 × executed", ""),
                ("speedup_vs_sequential", "vs token by token", ".1f"), ("max_logit_diff", "max |Δ logit|", ".1e")],
    "speculative": [("dtype", "dtype", ""), ("batch", "B", "d"), ("draft_loops", "r_d", "d"), ("k", "k", "d"),
                    ("draft_exit", "draft exit", ""), ("mean_draft_depth", "draft depth", ".2f"),
                    ("verify_start", "verify from loop", ".2f"),
                    ("draft_agreement", "draft agrees", ".3f"), ("acceptance", "accepted / drafted", ".3f"),
                    ("tokens_per_round", "tokens / round", ".2f"), ("full_ms_per_token", "full ms/tok", ".2f"),
                    ("draft_ms_per_round", "draft ms/round", ".2f"), ("verify_ms_per_round", "verify ms/round", ".2f"),
                    ("speedup", "speed-up", ".3f"), ("free_verify_bound", "bound (free verify)", ".3f"),
                    ("greedy_identical", "== full greedy", "")],
    # `--compare-reclaim`: the same rows' cache sizes and the run that keeps rejected drafts' columns
    "reclaim": [("dtype", "dtype", ""), ("batch", "B", "d"), ("draft_loops", "r_d", "d"), ("k", "k", "d"),
                ("draft_exit", "draft exit", ""), ("tokens_per_round", "tokens / round", ".2f"),
                ("keep_columns", "columns kept", "d"), ("cache_columns", "columns reclaimed", "d"),
                ("peak_columns", "peak used", "d"), ("compactions", "compactions", "d"),
                ("speedup_keep", "speed-up kept", ".3f"), ("speedup", "speed-up reclaimed", ".3f"),
                ("reclaim_gain", "reclaimed / kept", ".3f"), ("greedy_identical", "== full greedy", "")],
    "task": [("setting", "setting", ""), ("value", "q / r", ""), ("kv", "kv", ""), ("accuracy", "accuracy", ".4f"),
             ("selected_depth", "selected", ".2f"), ("executed_depth", "executed", ".2f"), ("executed_depth_ans", "executed @ans", ".2f"),
             ("time_ratio", "time / full", ".3f")],
    "scale": [("mixer", "mixer", ""), ("d_model", "d", "d"), ("dtype", "dtype", ""), ("batch", "B", "d"), ("schedule", "schedule", ""), ("executed_ratio", "executed / K", ".3f"),
              ("batch_depth", "core passes / step", ".2f"), ("time_ratio", "time / full", ".3f"), ("full_ms_per_token", "full ms/tok", ".2f"),
              ("target_met", "≤ 1.1 × executed", "")],
}


def plot_frontier(rows: list[dict], path, metric: str, title: str, xkey: str = "executed_depth") -> None:
    """Metric against executed depth, one line per KV policy, each point labelled with its time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("kv", "-"), []).append(r)
    for kv, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[xkey])
        ax.plot([r[xkey] for r in rs], [r[metric] for r in rs], "o-" if kv != "-" else "s", label=f"kv={kv}" if kv != "-" else "full depth")
        for r in rs:
            if r.get("time_ratio") is not None:
                ax.annotate(f"{r['time_ratio']:.2f}×t", (r[xkey], r[metric]), textcoords="offset points", xytext=(3, 3), fontsize=6)
    ax.set_xlabel("executed loops per token (the work that ran)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_task(rows: list[dict], path, title: str) -> None:
    """Accuracy against executed loops: the gate's q sweep as one line per KV policy (kv='full' runs every
    loop: left out, it is the table's output-selection reference), forced depths and full depth as markers;
    the first policy's points labelled with their time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.4, 3.7))
    for kv in dict.fromkeys(r["kv"] for r in rows if r["setting"] == "gate"):
        if kv == "full":
            continue
        rs = sorted((r for r in rows if r["setting"] == "gate" and r["kv"] == kv), key=lambda r: r["executed_depth"])
        ax.plot([r["executed_depth"] for r in rs], [r["accuracy"] for r in rs], "o-", label=f"gate q sweep, kv={kv}")
        for r in rs:
            if r.get("time_ratio") is not None:
                ax.annotate(f"q={r['value']}: {r['time_ratio']:.2f}×t", (r["executed_depth"], r["accuracy"]), textcoords="offset points",
                            xytext=(3, -9), fontsize=6)  # fmt: skip
    fx = [r for r in rows if r["setting"] == "replay" and r["kv"] == rows[1]["kv"]]
    ax.plot([r["executed_depth"] for r in fx], [r["accuracy"] for r in fx], "s", color="gray", label="forced depth r")
    full = [r for r in rows if r["setting"] == "full"]
    ax.plot([r["executed_depth"] for r in full], [r["accuracy"] for r in full], "*", ms=10, color="black", label="full depth")
    ax.set_xlabel("executed loops per token (the work that ran)")
    ax.set_ylabel("accuracy at <ans>")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def cmd_bench_adaptive(args) -> int:
    import os
    import subprocess
    import sys

    from .utils import cpuinfo

    name, flags = cpuinfo.model_name() or "unknown CPU", cpuinfo.flags()
    extra = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    cpu_description = lambda: f"{name} ({', '.join(extra) if extra else 'no avx512_bf16/amx'})"  # noqa: E731

    if sys.platform.startswith("linux") and "THP_MEM_ALLOC_ENABLE" not in os.environ and not args.same_process:
        # as `looplm bench decode`: PyTorch reads THP_MEM_ALLOC_ENABLE at its first allocation; re-run with it set
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
        child = subprocess.run([sys.executable, "-m", "looplm.cli", *sys.argv[1:], "--same-process"], env=env)
        return child.returncode
    from . import kernels

    kernels.load("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    runs = Path(args.runs_dir)
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes.split(",")]
    schedules = tuple(x.strip() for x in args.schedules.split(","))
    bad = [x for x in schedules if x not in ("token",) + BATCH_SCHEDULES]
    if bad:
        raise ValueError(f"--schedules {args.schedules!r}: unknown {bad}; choose from token, {', '.join(BATCH_SCHEDULES)}")
    bad = [x.strip() for x in args.scale_mixers.split(",") if x.strip() not in ("attention", "mamba2")]
    if bad:
        raise ValueError(f"--scale-mixers {args.scale_mixers!r}: unknown {bad}; choose from attention, mamba2")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches {args.batches!r}: give batch sizes ≥ 1, comma-separated (e.g. 1,8)")
    q = args.quick
    report = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "clock": args.clock, "sections": {}}
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    log(f"bench adaptive on {report['cpu']}, {report['threads']} threads, {args.clock} clock")
    need_lm = any(s in sections for s in ("quality", "timing", "kv_bytes", "speculative", "scale", "prefill"))
    if need_lm:
        if args.train or not (runs / "lm").exists():
            log(f"training the LM ({args.lm_config}) ...")
            train_lm(runs, args.data, args.lm_steps, args.lm_config)
        lm, tok = load_lm(runs)
        held = _held_out(tok, args.data, 16 if q else 32, 96 if q else 160)
        log(f"LM: {lm.config.n_core} blocks x K={lm.config.n_loops}, d={lm.config.d_model}, {lm.num_params():,} parameters")
    kl_grid = [float(v) for v in args.kl.split(",")]
    conv_grid = [float(v) for v in args.convergence.split(",")]
    policies = args.policies.split(",")
    depth_pool = None
    if "quality" in sections:
        rows = section_quality(lm, held, [("kl", e) for e in kl_grid] + [("convergence", e) for e in conv_grid], policies)
        report["sections"]["quality"] = rows
        log("\n## quality (teacher-forced, held-out text)\n" + _md(rows, TABLES["quality"]))
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            for crit in ("kl", "convergence"):
                rs = [r for r in rows if r["criterion"] == crit]
                plot_frontier(rs, Path(args.png_dir) / f"adaptive-lm-{crit}.png", "ppl", f"LM, {crit} criterion: PPL vs executed loops")
    if "frontier" in sections:
        settings = [("kl", e) for e in kl_grid] + [("convergence", e) for e in conv_grid]
        rows = section_frontier(lm, held[:8], settings, "copy", 2 if q else args.runs, args.clock)
        report["sections"]["frontier"] = rows
        log("\n## LM frontier: PPL vs executed depth vs time (teacher-forced, batch 8, kv=copy)\n" + _md(rows, TABLES["frontier"]))
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            pts = [dict(r, kv=r["criterion"]) for r in rows]
            plot_frontier(pts, Path(args.png_dir) / "adaptive-lm-frontier.png", "ppl",
                          "LM (2x4, d=256): PPL vs executed loops; labels: time / full depth")
    if "kv_bytes" in sections:
        base = kv_bytes_per_token(lm, "copy")
        rows = [{"kv": kv, "bytes_per_token": kv_bytes_per_token(lm, kv), "ratio": kv_bytes_per_token(lm, kv) / base}
                for kv in ("copy", "propagate", "full", "shared")]  # fmt: skip
        report["sections"]["kv_bytes"] = rows
        log("\n## KV bytes per token\n" + _md(rows, TABLES["kv_bytes"]))
    if "prefill" in sections:
        settings = [("kl", e, kv) for e in kl_grid for kv in ("copy", "propagate")] + [("convergence", e, "copy") for e in conv_grid]
        rows = section_prefill(lm, held[:8], settings, 2 if q else args.runs, args.clock, dtypes)
        report["sections"]["prefill"] = rows
        log("\n## per-token exit in one forward (every token after the first; held-out text, batch 8)\n" + _md(rows, TABLES["prefill"]))
    if "timing" in sections or "scale" in sections:
        prompts = {B: _held_out(tok, args.data, B, 32, seed=1) for B in batches}
        settings = [("kl", e, kv) for e in [kl_grid[len(kl_grid) // 2]] for kv in ("copy", "propagate")]
        settings += [("convergence", e, "copy") for e in [conv_grid[len(conv_grid) // 2]]]
        if "timing" in sections:
            rows = section_timing(lm, prompts, settings, 16 if q else args.new, 2 if q else args.runs, args.clock, dtypes,
                                  schedules, args.compare_carry)
            report["sections"]["timing"] = rows
            log("\n## timing (decode only, interleaved with full depth)\n" + _md(rows, TABLES["timing"]))
        # the LM's own exit depths at the middle kl threshold (the pool the scale section replays)
        from .decode.token_schedule import AdaptiveDecoder

        dec = AdaptiveDecoder(lm, held.shape[0], held.shape[1], {"criterion": "kl", "threshold": kl_grid[len(kl_grid) // 2]})
        dec.score(held, 8)
        depth_pool = torch.stack(dec.stats.selected).flatten()
    if "scale" in sections:
        rows = section_scale(depth_pool, [int(w) for w in args.widths.split(",")], (1, 8), 16 if q else args.new,
                             2 if q else args.runs, args.clock, dtypes, schedules,
                             tuple(x.strip() for x in args.scale_mixers.split(",")))
        report["sections"]["scale"] = rows
        log("\n## scale (random weights, the LM's exit depths replayed)\n" + _md(rows, TABLES["scale"]))
    if "speculative" in sections:
        prompts = {B: _held_out(tok, args.data, B, 16, seed=2) for B in batches}
        rows = section_speculative(lm, held, prompts, [int(r) for r in args.drafts.split(",")], [int(k) for k in args.k.split(",")],
                                   16 if q else args.new, 2 if q else args.runs, args.clock, dtypes,
                                   [e for e in args.draft_exits.split(",") if e], args.compare_reclaim)
        report["sections"]["speculative"] = rows
        log("\n## self-speculative decoding (greedy)\n" + _md(rows, TABLES["speculative"]))
        if args.compare_reclaim:
            log("\n## rejected drafts' cache columns: reclaimed (default) vs kept (reclaim=False), cache columns "
                "per loop and layer\n" + _md(rows, TABLES["reclaim"]))
    if "task" in sections:
        from .tasks.train import load_task_run

        if args.train or not (runs / "phop-gate2" / "model.safetensors").exists():
            log("training the p-hop exit-gate model (stage 1, stage 2) ...")
            train_phop(runs)
        m, cfg = load_task_run(runs / "phop-gate2")
        qs = [float(v) for v in args.qs.split(",")]
        rows = section_task(m, cfg, qs, policies[:2] if q else policies, list(range(1, m.config.n_loops)), 8,
                            2 if q else args.runs, args.clock, count=500 if q else None)
        report["sections"]["task"] = rows
        log("\n## p-hop with the exit gate (teacher-forced decoding, accuracy at <ans>)\n" + _md(rows, TABLES["task"]))
        if args.png_dir:
            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            plot_task(rows, Path(args.png_dir) / "adaptive-phop-gate.png", "p-hop 1⊗4 (d = 64), two-stage exit gate: accuracy vs executed loops")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def register(sub) -> None:
    """``bench adaptive`` under ``looplm bench`` (called by :func:`looplm.bench.register`)."""
    a = sub.add_parser("adaptive", help="per-token exit and self-speculative decoding vs full depth, on models trained here")
    a.add_argument("--runs-dir", default="runs/adaptive-bench", help="where the trained models live (trained there if missing)")
    a.add_argument("--train", action="store_true", help="(re)train the models first (the LM resumes from its newest checkpoint)")
    a.add_argument("--data", default="/work/shared/data/tinyshakespeare.txt", help="the LM's corpus (a text file)")
    a.add_argument("--lm-steps", type=int, default=None, help="override the LM's training steps")
    a.add_argument("--lm-config", default=LM_CONFIG, help="the LM's training YAML (configs/bench/adaptive-lm-1024.yaml: the "
                   "wider LM whose decode streams its weights from memory; give it its own --runs-dir)")
    a.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    a.add_argument("--kl", default="0.001,0.003,0.01,0.03,0.1", help="ε grid of the kl criterion (the timing section takes the middle one)")
    a.add_argument("--convergence", default="0.2,0.3,0.4,0.5,0.6", help="ε grid of the convergence criterion (the timing section takes the middle one; on the bench LM updates stay above 0.2 until the last loop)")
    a.add_argument("--qs", default="0.3,0.5,0.7,0.9,0.95", help="q grid of the gate criterion (task)")
    a.add_argument("--policies", default="copy,propagate,shared,full", help="KV policies compared")
    a.add_argument("--drafts", default="1,2,3", help="speculative draft loop counts r_d")
    a.add_argument("--k", default="2,4", help="speculative tokens drafted per round")
    a.add_argument("--draft-exits", default="", help="speculative drafts whose depth an exit criterion picks (at most "
                   "max(--drafts) loops), comma-separated: kl:0.01,convergence:0.3")
    a.add_argument("--compare-reclaim", action="store_true", help="also time each speculative setting keeping rejected "
                   "drafts' cache columns (reclaim=False) in the same alternation, and print their cache sizes")
    a.add_argument("--compare-carry", action="store_true", help="also time each kv=propagate setting of the timing "
                   "section with its fills written at the exit (not carried into the next core pass) in the same alternation")
    a.add_argument("--widths", default="512,1024", help="backbone widths of the scale section")
    a.add_argument("--scale-mixers", default="attention", help="block kinds of the scale section: attention, mamba2")
    a.add_argument("--schedules", default="token,depth", help="batch schedules timed at batch 8 beside full depth "
                   "(token, depth, static: the fixed-shape depth schedule, made for CUDA, static-compiled: its pass "
                   "through torch.compile)")
    a.add_argument("--dtypes", default="fp32,bf16")
    a.add_argument("--batches", default="1,8", help="batch sizes of the timing and speculative sections")
    a.add_argument("--new", type=int, default=48, help="decoded tokens per timing run")
    a.add_argument("--timing-runs", dest="runs", type=int, default=5, help="timing runs per setting (medians)")
    a.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--quick", action="store_true", help="fewer tokens, runs and settings (a smoke run)")
    a.add_argument("--png-dir", default=None, help="write the accuracy / PPL vs executed-depth plots here")
    a.add_argument("--out", default=None, help="write the full report (JSON) here")
    a.add_argument("--json", action="store_true")
    a.add_argument("--same-process", action="store_true", help=argparse_suppress())
    a.set_defaults(func=cmd_bench_adaptive)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS
