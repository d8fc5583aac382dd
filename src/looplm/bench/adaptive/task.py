"""Section ``task`` of ``looplm bench adaptive``: p-hop accuracy at <ans> vs selected / executed depth vs time
over the exit gate's q (and fixed depths), under teacher-forced decoding with exits.
"""

from __future__ import annotations

import torch

from ...eval.decode_timing import FullDepth, decode_timing


@torch.inference_mode()
def section_task(
    model, cfg, qs, policies, fixed, time_batch: int, runs: int, clock: str, count: int | None = None
) -> list[dict]:
    """p-hop accuracy at <ans> under teacher-forced decoding with exits (every token of the sequence decoded
    one at a time, its own exit), next to the full forward; wall time per token at ``time_batch``."""
    from ...decode.token_schedule import AdaptiveDecoder

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
            spec = (
                {"criterion": "gate", "threshold": 1.0, "kv": "full"}
                if crit == "full"
                else {"criterion": crit, ("threshold" if crit == "gate" else "depths"): v, "kv": kv}
            )
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
            rows.append(
                {
                    "kv": kv if crit != "full" else "-",
                    "setting": crit,
                    "value": v,
                    "accuracy": correct / ids.shape[0],
                    "selected_depth": float(torch.stack(sel).mean()),
                    "executed_depth": float(torch.stack(ex).mean()),
                    "selected_depth_ans": float(torch.stack(sel_ans).mean()),
                    "executed_depth_ans": float(torch.stack(ex_ans).mean()),
                }
            )
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
