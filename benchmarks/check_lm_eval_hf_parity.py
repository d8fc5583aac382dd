"""lm-eval's own `hf` model on a `looplm export hf` directory vs looplm's lm-eval model on the checkpoint:
rolling log-likelihood (perplexity tasks) of a local text, document by document.

    python benchmarks/check_lm_eval_hf_parity.py CHECKPOINT TEXT [--export DIR] [--docs 20] [--max-length 256]

Splits TEXT into ``--docs`` documents of ``--chars`` characters, scores each with both models (the same
``max_length``; lm-eval's windows: disjoint, each token predicted once, the first from the prefix token)
and prints the prefix token each used, the word perplexity of each and the largest per-document
difference. Not a timing benchmark. Needs lm-eval with its hf extra (accelerate).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class _Req:
    def __init__(self, *args):
        self.args = args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("text")
    ap.add_argument("--export", default=None, help="an export of CHECKPOINT (default: export it to a temp dir)")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--chars", type=int, default=1000)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--prefix-token-id", type=int, default=None, help="passed to both models")
    args = ap.parse_args()
    from lm_eval.models.huggingface import HFLM

    from looplm.eval.harness import LoopLMEvalModel
    from looplm.hf.export import export_hf

    text = Path(args.text).read_text()
    docs = [text[i * args.chars : (i + 1) * args.chars] for i in range(args.docs)]
    export = args.export or str(export_hf(args.checkpoint, Path(tempfile.mkdtemp()) / "export"))
    kw = {} if args.prefix_token_id is None else {"prefix_token_id": args.prefix_token_id}
    ours = LoopLMEvalModel(args.checkpoint, max_length=args.max_length, batch_size=4, **kw)
    hf = HFLM(pretrained=export, trust_remote_code=True, max_length=args.max_length, batch_size=4, device="cpu", **kw)
    a = ours.loglikelihood_rolling([_Req(d) for d in docs], disable_tqdm=True)
    b = hf.loglikelihood_rolling([_Req(d) for d in docs], disable_tqdm=True)
    words = sum(len(d.split()) for d in docs)
    print(f"{len(docs)} documents, {words} words, max_length {args.max_length}")
    print("| model | prefix token | word perplexity |")
    print("| --- | ---: | ---: |")
    print(f"| looplm (checkpoint) | {ours.prefix_token_id} | {math.exp(-sum(a) / words):.4f} |")
    print(f"| lm-eval hf (export) | {hf.prefix_token_id} | {math.exp(-sum(b) / words):.4f} |")
    print(f"largest per-document |log-likelihood difference|: {max(abs(x - y) for x, y in zip(a, b)):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
