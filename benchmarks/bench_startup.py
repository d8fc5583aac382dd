"""Start-up of ``looplm generate``: wall time of one short generation from a checkpoint, and where the
import time goes, for one or more source trees, alternating them run by run (medians).

    python benchmarks/bench_startup.py CHECKPOINT [--src before=/tmp/old/src --src after=src] [--repeats 5]

Each run is a fresh ``python -m looplm.cli generate --checkpoint CHECKPOINT --max-new-tokens 1`` with
``PYTHONPATH`` set to the tree, timed in wall and CPU seconds (CPU time is what a shared machine's load
disturbs least); the import breakdown comes from three ``python -X importtime`` runs per tree (medians of
the cumulative time of the largest imports). Prints a Markdown table; nothing is cached between runs except
the OS page cache (a first untimed run per tree warms it).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


THREADS: list[str] = []  # --threads: OMP_NUM_THREADS of the runs


def _env(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src, HF_HUB_OFFLINE="1")
    if THREADS:
        env["OMP_NUM_THREADS"] = THREADS[0]
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_ext"))
    return env


def _cmd(ckpt: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        *extra,
        "-m",
        "looplm.cli",
        "generate",
        "--checkpoint",
        ckpt,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "1",
    ]


def wall(ckpt: str, src: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+sys) of one run; CPU time is what a shared machine's load disturbs least."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(_cmd(ckpt, []), env=_env(src), check=True, capture_output=True)
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def import_profile(ckpt: str, src: str, top: int = 6) -> tuple[float, list[tuple[str, float]]]:
    """(total import seconds, the largest packages by cumulative import time) from ``-X importtime``."""
    r = subprocess.run(_cmd(ckpt, ["-X", "importtime"]), env=_env(src), check=True, capture_output=True, text=True)
    rows = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((len(m.group(3)), m.group(4), int(m.group(2)) / 1e6))
    total = sum(c for depth, _, c in rows if depth == 1)  # top-level imports (one space of indent)
    interesting = (
        "torch._dynamo",
        "transformers",
        "looplm.kernels",
        "looplm.train",
        "safetensors",
        "tokenizers",
        "torch",
    )
    shown = {}
    for _, name, c in rows:
        if name in interesting:
            shown[name] = max(shown.get(name, 0.0), c)
    return total, sorted(shown.items(), key=lambda kv: -kv[1])[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument(
        "--src",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a source tree to time (repeatable; default: this checkout's src)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the runs (on a shared 2-core machine, 2 threads make one small product "
        "~75x slower than 1 while other processes hold a core; 1 isolates the start-up work)",
    )
    args = ap.parse_args()
    if args.threads:
        THREADS.append(str(args.threads))
    srcs = dict(s.split("=", 1) for s in (args.src or ["this=src"]))
    srcs = {k: str(Path(v).resolve()) for k, v in srcs.items()}
    from looplm.utils import cpuinfo

    print(
        f"CPU: {cpuinfo.model_name() or 'unknown'}; checkpoint {args.checkpoint}; median of {args.repeats}; "
        f"OMP_NUM_THREADS={args.threads or 'unset'}"
    )
    for s in srcs.values():  # warm the page cache and any build
        wall(args.checkpoint, s)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in srcs}
    for _ in range(args.repeats):  # alternate the trees run by run
        for k, s in srcs.items():
            times[k].append(wall(args.checkpoint, s))
    print("| tree | wall s (median) | wall min | CPU s (median) | imports s | largest imports (cumulative s) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for k, s in srcs.items():
        profiles = [import_profile(args.checkpoint, s) for _ in range(3)]  # medians of three -X importtime runs
        total = statistics.median(t for t, _ in profiles)
        names = [n for n, _ in profiles[0][1]]
        top = [(n, statistics.median(dict(p).get(n, 0.0) for _, p in profiles)) for n in names]
        tops = ", ".join(f"{n} {c:.2f}" for n, c in top)
        w = [a for a, _ in times[k]]
        c = [b for _, b in times[k]]
        print(
            f"| {k} | {statistics.median(w):.2f} | {min(w):.2f} | {statistics.median(c):.2f} | {total:.2f} | {tops} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
