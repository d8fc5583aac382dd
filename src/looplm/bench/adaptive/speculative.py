"""Section ``speculative`` of ``looplm bench adaptive``: greedy self-speculative decoding (an ``r_d``-loop or
exit-picked draft) against full depth: agreement, accepted tokens per round, speed-up and its free-verification bound.
"""

from __future__ import annotations

import statistics

import torch

from ...eval.decode_timing import _now


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
    from ...decode.generate import generate
    from ...decode.sampling import decode_context

    now = _now(clock)
    names = ("full", "spec", "keep") if compare_reclaim else ("full", "spec")
    specs = {"spec": spec, "keep": {**spec, "reclaim": False}}
    times = {k: [] for k in names}
    t_rest = []
    with decode_context(model, prompts.shape[0]):
        for run in range(runs + 1):  # run 0 warms up
            outs = {}
            for k in names if run % 2 == 0 else names[::-1]:
                t0 = now()
                outs[k] = (
                    generate(model, prompts, new_tokens)
                    if k == "full"
                    else generate(model, prompts, new_tokens, speculative=specs[k], return_stats=True)
                )
                dt = now() - t0
                if run:
                    times[k].append(dt)
                    if k == "spec":
                        t_rest.append(dt - outs["spec"][1].verify_s)
    spec_out, st = outs["spec"]
    t_full = times["full"]
    ratios = [f / s for f, s in zip(t_full, times["spec"])]
    res = {
        "speedup": statistics.median(ratios),
        "speedups": ratios,
        "stats": st.summary(),
        "identical": bool(torch.equal(spec_out, outs["full"])),
        "full_s": statistics.median(t_full),
        "bound": statistics.median(f / r for f, r in zip(t_full, t_rest)),
    }
    if compare_reclaim:
        keep_out, keep_st = outs["keep"]
        res.update(
            speedup_keep=statistics.median(f / s for f, s in zip(t_full, times["keep"])),
            reclaim_gain=statistics.median(s_keep / s for s_keep, s in zip(times["keep"], times["spec"])),
            identical_keep=bool(torch.equal(keep_out, outs["full"])),
            keep_columns=keep_st.capacity,
        )
    return res


def section_speculative(
    model, ids, prompts_by_batch, drafts, ks, new_tokens, runs, clock, dtypes, exits=(), compare_reclaim: bool = False
) -> list[dict]:
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
                    rows.append(
                        {
                            "dtype": str(dt).replace("torch.", ""),
                            "batch": B,
                            "draft_loops": r,
                            "k": k,
                            "draft_exit": e or "-",
                            "mean_draft_depth": st.get("mean_draft_depth", float(r)),
                            "verify_start": st.get("mean_verify_start", r + 1.0),
                            "draft_agreement": agree[r] if e is None else None,
                            "accepted_per_round": st["accepted_per_round"],
                            "tokens_per_round": st["tokens_per_round"],
                            "acceptance": st["acceptance"],
                            "speedup": res["speedup"],
                            "speedups": res["speedups"],
                            "full_ms_per_token": 1000 * t_full / new_tokens,
                            "draft_ms_per_round": st["draft_ms_per_round"],
                            "verify_ms_per_round": st["verify_ms_per_round"],
                            "free_verify_bound": res["bound"],
                            "cache_columns": st["cache_columns"],
                            "peak_columns": st["peak_columns"],
                            "compactions": st["compactions"],
                            "keep_columns": res.get("keep_columns"),
                            "speedup_keep": res.get("speedup_keep"),
                            "reclaim_gain": res.get("reclaim_gain"),
                            "greedy_identical": res["identical"] and res.get("identical_keep", True),
                            "clock": clock,
                        }
                    )
    model.float()
    return rows
