"""What fraction of a real text's tokens could leave Nanbeige4.2 after pass 1, and at what KL.

    looplm import hf ~/models/Nanbeige4.2-3B runs/nanbeige --dtype bfloat16
    python benchmarks/check_nanbeige_pass1.py runs/nanbeige --text my.txt [--seq-len 1024] [--batches 4]

For every token of ``--text`` (tokenised by the checkpoint's own tokenizer, cut into ``--seq-len`` windows): the KL
between the next-token distributions after pass 1 and pass 2, ``KL(p¹ ‖ p²)``, and whether their argmax agrees
(:func:`looplm.hf.nanbeige.last_pass_agreement`); prints the fraction of tokens below each ``ε``. An oracle: it runs
both passes (deciding the exit needs pass 2). The decoding that acts on it — ``looplm generate --exit kl:ε`` —
compares successive passes, so at the trained 2 passes it never exits before the second; use ``--max-loops 3``
to let tokens leave after pass 2 of 3 instead, and ``--kv-policy`` for what later tokens see of the skipped pass.
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> int:
    from looplm.checkpoint_io import load_model_for_inference
    from looplm.hf.nanbeige import last_pass_agreement

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="an imported Nanbeige checkpoint (looplm import hf)")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batches", type=int, default=4, help="windows of --seq-len tokens measured (one at a time)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[1e-3, 1e-2, 5e-2, 0.1, 0.5])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    model, tok = load_model_for_inference(args.run)
    model = model.to(args.device).eval()
    if not 2 <= args.seq_len <= model.config.max_seq_len:
        raise SystemExit(
            f"error: --seq-len {args.seq_len} must be in [2, {model.config.max_seq_len}] (the model's max_seq_len)"
        )
    ids = torch.tensor(tok.encode(open(args.text, encoding="utf-8").read()), dtype=torch.long)
    n = min(args.batches, len(ids) // args.seq_len)
    if n < 1:
        raise SystemExit(f"error: {args.text!r} has {len(ids)} tokens, fewer than --seq-len {args.seq_len}")
    rows = [
        last_pass_agreement(
            model, ids[i * args.seq_len : (i + 1) * args.seq_len][None].to(args.device), args.thresholds
        )
        for i in range(n)
    ]
    tokens = sum(r["tokens"] for r in rows)
    res = {
        "tokens": tokens,
        "windows": n,
        "kl_mean": sum(r["kl_mean"] * r["tokens"] for r in rows) / tokens,
        "top1_agreement": sum(r["top1_agreement"] * r["tokens"] for r in rows) / tokens,
        "below": {e: sum(r["below"][e] * r["tokens"] for r in rows) / tokens for e in rows[0]["below"]},
    }
    print("| ε | tokens with KL(p¹ ‖ p²) < ε |\n| ---: | ---: |")
    for e, f in res["below"].items():
        print(f"| {e:g} | {f:.1%} |")
    print(
        f"\n{tokens} tokens; mean KL {res['kl_mean']:.4g}; top-1 agreement of pass 1 and pass 2 {res['top1_agreement']:.1%}"
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
