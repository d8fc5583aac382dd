"""Check `looplm export hf` against the installed transformers (run it under each version you care about).

    python benchmarks/check_hf_export_compat.py
    # e.g. transformers 4.57 next to 5.x:
    python -m venv /tmp/v457 --system-site-packages && /tmp/v457/bin/pip install "transformers==4.57.1"
    /tmp/v457/bin/python benchmarks/check_hf_export_compat.py

For tiny CoreLoop / Mamba-2 / Qwen3 models with random weights: exported logits == looplm's,
cached greedy == uncached == looplm's at K+2 loops, a left-padded row == the row alone, beam search
runs, and AutoTokenizer loads the exported PreTrainedTokenizerFast. Prints one line per model.
Not a timing benchmark (nothing is timed).
"""

import os
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import looplm  # noqa: E402
from looplm.hf.export import export_hf  # noqa: E402


def main() -> int:
    print("transformers", transformers.__version__, "| torch", torch.__version__)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ok = True
    for name in ["tiny-coreloop", "tiny-mamba2", "tiny-qwen3"]:
        m = looplm.build(name).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out = export_hf(m, tempfile.mkdtemp() + "/x", tokenizer="byte")
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        ids = torch.randint(0, 200, (1, 7))
        with torch.no_grad():
            same_logits = torch.equal(hf(ids).logits, m(ids).logits)
        K = m.config.n_loops
        g = hf.generate(ids, max_new_tokens=6, do_sample=False, num_loops=K + 2)
        g_nocache = hf.generate(ids, max_new_tokens=6, do_sample=False, num_loops=K + 2, use_cache=False)
        ref = m.generate(ids, max_new_tokens=6, num_loops=K + 2)
        a, b = ids[0], ids[0, 4:]
        batch = torch.full((2, 7), 258)
        batch[0], batch[1, 4:] = a, b
        mask = (torch.arange(7)[None] >= torch.tensor([[0], [4]])).long()
        padded = hf.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
        alone = hf.generate(b[None], max_new_tokens=5, do_sample=False)
        beams = hf.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)
        checks = {
            "logits": same_logits,
            "cached==looplm": torch.equal(g, ref),
            "cached==uncached": torch.equal(g, g_nocache),
            "padded==alone": torch.equal(padded[1, 4:], alone[0]),
            "beams": beams.shape == (1, 11),
            "tokenizer": tok("ab<eos>").input_ids == [97, 98, 60, 101, 111, 115, 62],
        }
        ok &= all(checks.values())
        print(
            f"{name:14s} " + "  ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checks.items()),
            f"({type(tok).__name__})",
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
