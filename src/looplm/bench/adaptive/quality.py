"""Sections ``quality``, ``frontier`` and ``kv_bytes`` of ``looplm bench adaptive``: teacher-forced decoding
of held-out text with exits against full depth (agreement, ``KL(full ‖ adaptive)``, PPL, depths), PPL vs
executed depth vs time, and the KV-cache bytes one token occupies per policy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...eval.decode_timing import FullDepth, decoded_nll, teacher_forced_timing


@torch.inference_mode()
def teacher_forced_quality(
    model, ids: torch.Tensor, exit, prompt_len: int = 8, ref_logits: torch.Tensor | None = None
) -> dict:
    """Score ``ids [B, T]`` token by token with exits (:meth:`AdaptiveDecoder.score`) against full depth:
    greedy agreement and ``KL(full ‖ adaptive)`` of every decoded position, PPL of both, the depth summary."""
    from ...decode.token_schedule import AdaptiveDecoder

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
        "agreement": float((a.argmax(-1) == r.argmax(-1)).float().mean()),
        "kl_to_full": float(kl.mean()),
        "ppl": math.exp(float(nll)),
        "ppl_full": math.exp(float(nll_full)),
        **dec.stats.summary(),
    }


def kv_bytes_per_token(model, kv: str, batch: int = 1) -> float:
    """KV-cache bytes one token occupies (every attention slot of every loop; ``shared``: one per layer)."""
    from ...decode.token_schedule import AdaptiveDecoder

    dec = AdaptiveDecoder(model, batch, 4, {"criterion": "replay", "depths": 1, "kv": kv})
    with torch.no_grad():
        dec(torch.zeros(batch, 2, dtype=torch.long))
    total = 0
    for s in dec.cache.physical_slots():
        k = getattr(s, "_k", None)
        if k is not None:
            total += 2 * k.numel() * k.element_size() // k.shape[2]  # one column of keys and values
    return total / batch


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
    from ...decode.token_schedule import AdaptiveDecoder

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
        rows.append(
            {
                "criterion": crit,
                "threshold": eps,
                "kv": kv if key != "full" else "-",
                "ppl": math.exp(nll),
                "executed_depth": st["executed_depth"],
                "selected_depth": st["selected_depth"],
                "ms_per_token": r["ms_per_token"],
                "time_ratio": r["ratio"],
                "clock": clock,
            }
        )
    return rows
