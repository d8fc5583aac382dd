"""Decode speed of a `looplm export hf` directory through transformers, next to `looplm generate`.

    python benchmarks/bench_hf_export.py CHECKPOINT [--export DIR] [--before SRC:EXPORT] [--rounds 3]

Contenders, each in its own process (the code under test differs), run in alternation round by round:

* ``looplm``               — ``looplm.decode.generate`` on the checkpoint (looplm's lean path and CPU kernels);
* ``hf->installed``        — ``AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)`` with
                             this checkout's looplm importable (its source = the export's): ``generate()``
                             routed to looplm's ``generate``;
* ``hf->bundled, no looplm`` — the same call in ``python -I -S`` with a ``sys.path`` that cannot import looplm:
                             the export's own copy of the model code on its lean path (no kernels);
* ``hf loop (forward+cache)`` — transformers' own decoding loop over the export's ``forward`` with a cache
                             (``GenerationMixin.generate``), what requests outside the lean path get;
* ``before``               — with ``--before SRC:EXPORT``: an export written by an older looplm tree ``SRC``
                             (its remote code imports looplm from ``SRC``), through transformers.

Each process loads the model in bf16 (``--dtype``), decodes ``--new`` tokens greedily after a
``--prompt``-token prompt, and reports ms per decoded token = (time(n) − time(1)) / (n − 1), the median of
``--reps`` timings; the table gives each contender's median over rounds and its ratio to ``looplm``.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, statistics, sys, time
spec = json.loads(sys.argv[1])
if spec.get("hide_looplm"):
    import site
    sys.path[:0] = spec["site"]
    try:
        import looplm  # noqa: F401
        raise SystemExit("looplm is importable; the no-looplm contender must not see it")
    except ImportError:
        pass
import torch
torch.set_num_threads(spec["threads"])
dt = getattr(torch, spec["dtype"])
torch.manual_seed(0)
ids = torch.randint(0, 200, (1, spec["prompt"]))
if spec["kind"] == "looplm":
    from looplm.checkpoint_io import load_model_for_inference
    model, _ = load_model_for_inference(spec["path"])
    model = model.to(dt)
    run = lambda n: model.generate(ids, max_new_tokens=n)
else:
    import transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(spec["path"], trust_remote_code=True, dtype=dt).eval()
    gen = transformers.GenerationMixin.generate if spec["kind"] == "hf-loop" else type(model).generate
    run = lambda n: gen(model, ids, max_new_tokens=n, do_sample=False)
    note = getattr(getattr(model, "looplm_implementation", None), "name", "looplm (old export)")
run(4)  # warm up: kernels built / loaded, pages touched
def timed(n):
    t = time.perf_counter(); out = run(n); dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + n, out.shape
    return dt
per = []
for _ in range(spec["reps"]):
    t1 = timed(1); tn = timed(spec["new"])
    per.append((tn - t1) / (spec["new"] - 1) * 1e3)
print(json.dumps({"ms_per_token": statistics.median(per), "all": per}))
"""


def _run(spec: dict, env_src: str | None) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_ext"))
    if env_src is not None:
        env["PYTHONPATH"] = env_src
    cmd = [sys.executable] + (["-I", "-S"] if spec.get("hide_looplm") else []) + ["-c", WORKER, json.dumps(spec)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{spec['name']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["ms_per_token"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--export", default=None, help="export directory (default: export the checkpoint into a temp dir)")
    ap.add_argument(
        "--before", default=None, metavar="SRC:EXPORT", help="an older looplm src tree and an export it wrote"
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = str(ROOT / "src")
    sys.path.insert(0, src)
    from looplm.utils import cpuinfo

    export = args.export
    if export is None:
        from looplm.hf.export import export_hf

        export = str(export_hf(args.checkpoint, Path(tempfile.mkdtemp(prefix="looplm-bench-")) / "export"))
    common = {"dtype": args.dtype, "prompt": args.prompt, "new": args.new, "reps": args.reps, "threads": args.threads}
    contenders = [
        ({"name": "looplm generate", "kind": "looplm", "path": args.checkpoint}, src),
        ({"name": "hf generate -> installed looplm", "kind": "hf", "path": export}, src),
        (
            {
                "name": "hf generate -> bundled, no looplm",
                "kind": "hf",
                "path": export,
                "hide_looplm": True,
                "site": site.getsitepackages(),
            },
            None,
        ),
        ({"name": "hf loop over forward+cache", "kind": "hf-loop", "path": export}, src),
    ]
    if args.before:
        bsrc, bexp = args.before.split(":", 1)
        contenders.append(({"name": "before: hf generate (old export)", "kind": "hf", "path": bexp}, bsrc))
    times: dict[str, list[float]] = {c["name"]: [] for c, _ in contenders}
    for r in range(args.rounds):
        for spec, env_src in contenders:
            times[spec["name"]].append(_run({**common, **spec}, env_src))
            print(f"round {r + 1}: {spec['name']}: {times[spec['name']][-1]:.1f} ms/token", file=sys.stderr)
    base = statistics.median(times["looplm generate"])
    print(
        f"CPU: {cpuinfo.model_name() or 'unknown'}; {args.dtype}; torch threads {args.threads}; prompt {args.prompt}, "
        f"{args.new} new tokens, greedy; median of {args.rounds} rounds (each the median of {args.reps})"
    )
    print("| contender | ms/token | x looplm generate |")
    print("| --- | ---: | ---: |")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} | {m / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
