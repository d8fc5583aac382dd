"""Section ``timing`` of ``looplm bench adaptive``: decode time per token against full depth, per setting,
batch, dtype and batch schedule (the contenders and how they are timed, shared with the ``scale`` section).
"""

from __future__ import annotations

from ...eval.decode_timing import FullDepth, decode_timing


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
    from ...decode.token_schedule import AdaptiveDecoder
    from ...decode.depth_schedule import DepthBatchedDecoder
    from ...decode.static_schedule import StaticDepthDecoder

    cont = {"full": lambda b, c: FullDepth(m, b, c)}
    classes = {"token": AdaptiveDecoder, "depth": DepthBatchedDecoder, "static": StaticDepthDecoder}
    for name, spec in specs.items():
        batched = [s for s in BATCH_SCHEDULES if s in schedules] if B > 1 and spec["kv"] != "full" else []
        for sched in ["token"] + batched:
            opts = {
                "schedule": sched.removesuffix("-compiled"),
                **({"compile": True} if sched == "static-compiled" else {}),
            }
            cont[f"{name}/{sched}"] = lambda b, c, spec=spec, opts=opts: classes[opts["schedule"]](
                m, b, c, spec if opts["schedule"] == "token" else {**spec, **opts}
            )
        if at_exit and spec["kv"] == "propagate":  # the same decoders with the fills written at the exit
            for sched in ["token"] + [s for s in batched if s == "depth"]:  # (static refuses propagate)
                cont[f"{name}/{sched}-at-exit"] = lambda b, c, make=cont[f"{name}/{sched}"]: _at_exit(make(b, c))
    return cont


def _timed(m, prompts, new_tokens, cont, runs, clock) -> dict:
    """Batch 1 and token schedules only: step by step, interleaved token by token (:func:`decode_timing`);
    with a depth-schedule contender (rows at their own tokens): whole generations, interleaved run by run
    (:func:`generation_timing`)."""
    from ...eval.decode_timing import generation_timing

    if any(k.rsplit("/", 1)[-1].removesuffix("-at-exit") in BATCH_SCHEDULES for k in cont):
        return generation_timing(m, prompts, new_tokens, cont, runs=runs, clock=clock)
    return decode_timing(m, prompts, new_tokens, cont, runs=runs, clock=clock)


def section_timing(
    model,
    prompts_by_batch: dict,
    settings,
    new_tokens: int,
    runs: int,
    clock: str,
    dtypes,
    schedules=("token", "depth"),
    compare_carry: bool = False,
) -> list[dict]:
    """Decode time against full depth per setting, batch, dtype and schedule; with ``compare_carry`` each
    ``kv='propagate'`` setting also runs with its fills written at the exit (schedule ``<name>-at-exit``) in
    the same alternation."""
    rows = []
    for dt in dtypes:
        m = model.to(dt)
        for B, prompts in prompts_by_batch.items():
            specs = {
                f"{crit}:{eps}/{kv}": {"criterion": crit, "threshold": eps, "kv": kv} for crit, eps, kv in settings
            }
            res = _timed(m, prompts, new_tokens, _contenders(m, B, specs, schedules, compare_carry), runs, clock)
            full_ms = res["full"]["ms_per_token"]
            for name in list(res)[1:]:
                r = res[name]
                crit, eps, kv = next(st for st in settings if name.startswith(f"{st[0]}:{st[1]}/{st[2]}/"))
                ex = r["stats"]["executed_ratio"]
                rows.append(
                    {
                        "dtype": str(dt).replace("torch.", ""),
                        "batch": B,
                        "criterion": crit,
                        "threshold": eps,
                        "kv": kv,
                        "schedule": name.rsplit("/", 1)[1],
                        "full_ms_per_token": full_ms,
                        "ms_per_token": r["ms_per_token"],
                        "time_ratio": r["ratio"],
                        "executed_ratio": ex,
                        "selected_depth": r["stats"]["selected_depth"],
                        "executed_depth": r["stats"]["executed_depth"],
                        "batch_depth": r["stats"]["batch_depth"],
                        "flops_ratio": r["stats"]["flops_ratio"],
                        "target_met": r["ratio"] <= 1.1 * ex,
                        "ratios": r["ratios"],
                        "clock": clock,
                    }
                )
    model.float()
    return rows
