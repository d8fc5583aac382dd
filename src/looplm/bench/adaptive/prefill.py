"""Section ``prefill`` of ``looplm bench adaptive``: per-token exit in one forward
(:mod:`looplm.decode.exit_forward`) against the plain forward, and against scoring the same exits token by token.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from ...eval.decode_timing import _now


@torch.inference_mode()
def section_prefill(model, ids, settings, runs: int, clock: str, dtypes, sequential: bool = True) -> list[dict]:
    """Per-token exit in one forward (:func:`looplm.decode.exit_forward.adaptive_forward`, every token after the
    first) against the plain forward of the same text, interleaved run by run (rotating order, medians): wall
    time, executed and computed ratio (the packs' padding included), PPL of every position's next token. With
    ``sequential`` the same exits are also scored token by token (:meth:`AdaptiveDecoder.score`, the
    reference; one run): its time and the largest logit difference to the forward's (``max_logit_diff``)."""
    from ...decode.token_schedule import AdaptiveDecoder
    from ...decode.exit_forward import adaptive_forward
    from ...eval.decode_timing import _rotated

    now = _now(clock)
    B, T = ids.shape
    tgt = ids[:, 1:]
    nll = lambda lg: float(F.cross_entropy(lg[:, :-1].float().reshape(-1, lg.shape[-1]), tgt.reshape(-1)))  # noqa: E731
    rows = []
    for dt in dtypes:
        m = model.to(dt)
        specs = {(c, e, kv): {"criterion": c, "threshold": e, "kv": kv} for c, e, kv in settings}
        calls = {"full": lambda: m(ids).logits}
        calls.update(
            {k: (lambda spec=spec: adaptive_forward(m, ids, spec, full_depth_prefix=1)) for k, spec in specs.items()}
        )
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
            row = {
                "dtype": str(dt).replace("torch.", ""),
                "batch": B,
                "tokens": T,
                "criterion": k[0],
                "threshold": k[1],
                "kv": k[2],
                "selected_depth": st["selected_depth"],
                "executed_ratio": st["executed_ratio"],
                "computed_ratio": st["computed_ratio"],
                "ppl": math.exp(nll(out.logits)),
                "ppl_full": ppl_full,
                "full_ms": 1000 * full_s,
                "ms": 1000 * statistics.median(per_run[k]),
                "time_ratio": statistics.median([a / b for a, b in zip(per_run[k], per_run["full"])]),
                "clock": clock,
            }
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
