"""Depth extrapolation: perplexity at inference depths ``r`` other than the training loop count ``K``.

Every looped model can run ``r`` loops (inference depth ``p + s·r + c``, recurrence-effectiveness
paper). A sweep evaluates ``r`` over a list (``looplm eval ppl CKPT --loops 1..2K``) and writes a
depth table — ``r``, the conditioning grid, token PPL, loss and the **executed** forward FLOPs per
token at that depth (:func:`looplm.info.forward_flops_per_token`) — plus a plot of PPL against ``r``.

For timestep-conditioned models (rule ``timestep``) each ``r`` is evaluated on both grids the paper
defines: ``prefix`` (``T = L_train``, only ``r <= K``) and ``rescaled`` (``T = r``), passed as
``loop_options={"grid": ...}``. Other models have one row per ``r`` (grid ``-``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

__all__ = [
    "DepthRow",
    "parse_loops",
    "grids_for",
    "depth_sweep",
    "depth_table_markdown",
    "plot_depth",
    "write_depth_report",
    "run_depth_sweep",
]


def parse_loops(spec: "str | int", train_loops: int | None = None, allow_deep: bool = True) -> list[int]:
    """``"4"`` -> ``[4]``; ``"1..8"`` -> ``[1..8]``; ``"1,2,4"``; ``"1..2K"`` with ``K`` = ``train_loops``.
    Parts combine: ``"1..4,8,16"``. Every count must be >= 1; without ``allow_deep`` at most 64 x ``train_loops``
    (:data:`looplm.decode.exits.DEEP_LOOPS_FACTOR`: ``--loops 100000`` is a typo more often than a study)."""
    from ..decode.exits import DEEP_LOOPS_FACTOR

    if isinstance(spec, int):
        spec = str(spec)
    text = spec.replace(" ", "")
    if "K" in text:
        if train_loops is None:
            raise ValueError(f"--loops {spec!r}: 'K' needs the model's training loop count")
        text = re.sub(r"(\d*)K", lambda m: str(int(m.group(1) or 1) * train_loops), text)
    out: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\.\.(\d+))?", part)
        if not m:
            raise ValueError(
                f"--loops {spec!r}: expected r, a range a..b, or a comma-separated list (e.g. 1..8 or 1,2,4)"
            )
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if a < 1 or b < a:
            raise ValueError(f"--loops {spec!r}: loop counts must be >= 1 and ranges ascending, got {part!r}")
        if not allow_deep and train_loops is not None and b > DEEP_LOOPS_FACTOR * train_loops:
            raise ValueError(
                f"--loops {spec!r}: {b} loops is more than {DEEP_LOOPS_FACTOR}x the model's trained K = "
                f"{train_loops} (at most {DEEP_LOOPS_FACTOR * train_loops} without asking); pass --allow-deep "
                "to run that deep"
            )
        out += [r for r in range(a, b + 1) if r not in out]
    if not out:
        raise ValueError(f"--loops {spec!r}: no loop count given")
    return out


def grids_for(model, grid: str = "both") -> list[str | None]:
    """The conditioning grids to evaluate: ``[None]`` for unconditioned models; for timestep
    conditioning ``["prefix", "rescaled"]`` (``grid="both"``) or the one asked for."""
    if getattr(model.config.rule, "name", None) != "timestep":
        return [None]
    return ["prefix", "rescaled"] if grid == "both" else [grid]


class _AtDepth(nn.Module):
    """``model`` run at ``r`` loops on a given grid (what :func:`evaluate_documents` calls)."""

    def __init__(self, model, num_loops: int, grid: str | None):
        super().__init__()
        self.model, self.num_loops, self.grid = model, num_loops, grid

    def forward(self, x):
        return self.model(x, num_loops=self.num_loops, loop_options={"grid": self.grid} if self.grid else None)


@dataclass
class DepthRow:
    r: int
    grid: str  # "prefix" / "rescaled" / "-"
    effective_depth: int  # p + s·r + c
    token_ppl: float
    loss: float
    flops_per_token: int  # executed forward FLOPs per token at depth r
    tokens: int


def depth_sweep(
    model,
    tokenizer,
    documents,
    loops: list[int],
    *,
    grid: str = "both",
    seq_len: int,
    batch_size: int = 8,
    max_batches: int | None = None,
    device=None,
    precision: str = "fp32",
) -> list[DepthRow]:
    """Evaluate ``model`` at every ``r`` in ``loops`` (and grid) on the same documents."""
    from ..info import forward_flops_per_token
    from .ppl import evaluate_documents

    docs = list(documents)
    cfg = model.config
    rows = []
    for r in loops:
        for g in grids_for(model, grid):
            if g == "prefix" and r > cfg.n_loops:
                continue  # prefix inference needs r <= K
            res = evaluate_documents(
                _AtDepth(model, r, g),
                tokenizer,
                docs,
                seq_len=seq_len,
                batch_size=batch_size,
                max_batches=max_batches,
                device=device,
                precision=precision,
            )
            rows.append(
                DepthRow(
                    r=r,
                    grid=g or "-",
                    effective_depth=cfg.effective_depth(r),
                    token_ppl=res.token_ppl,
                    loss=res.loss,
                    flops_per_token=forward_flops_per_token(model, r, seq_len),
                    tokens=res.tokens,
                )
            )
    return rows


def depth_table_markdown(rows: list[DepthRow], train_loops: int) -> str:
    lines = [
        "| r | grid | effective depth | token PPL | loss | FLOPs / token |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for w in rows:
        mark = " (K)" if w.r == train_loops else ""
        lines.append(
            f"| {w.r}{mark} | {w.grid} | {w.effective_depth} | {w.token_ppl:.3f} | {w.loss:.4f} | {w.flops_per_token:,} |"
        )
    return "\n".join(lines)


def plot_depth(rows: list[DepthRow], train_loops: int, path, title: str = "") -> Path:
    """PPL against ``r`` (one line per grid, log PPL axis) and against executed FLOPs per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for g in dict.fromkeys(w.grid for w in rows):
        sel = [w for w in rows if w.grid == g]
        label = "unconditioned" if g == "-" else g
        a.plot([w.r for w in sel], [w.token_ppl for w in sel], marker="o", label=label)
        b.plot([w.flops_per_token for w in sel], [w.token_ppl for w in sel], marker="o", label=label)
    a.axvline(train_loops, color="gray", ls="--", lw=0.8)
    a.set(xlabel="inference loops r", ylabel="token PPL", yscale="log", title=title or f"K = {train_loops}")
    b.set(xlabel="forward FLOPs / token", ylabel="token PPL", xscale="log", yscale="log")
    a.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_depth_report(rows: list[DepthRow], train_loops: int, out_dir, meta: dict | None = None) -> tuple[Path, Path]:
    """``OUT/depth.json`` (rows + ``meta``) and ``OUT/depth.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "depth.json"
    js.write_text(json.dumps({**(meta or {}), "train_loops": train_loops, "rows": [asdict(w) for w in rows]}, indent=2))
    return js, plot_depth(rows, train_loops, out / "depth.png", title=(meta or {}).get("checkpoint", ""))


def run_depth_sweep(args, model, tokenizer, documents, loops: list[int], seq_len: int, device, checkpoint) -> int:
    """``looplm eval ppl CKPT --loops SPEC [--grid G] [--out DIR]``: print the depth table (or JSON),
    and with ``--out`` write ``depth.json`` and ``depth.png`` there."""
    rows = depth_sweep(
        model,
        tokenizer,
        documents,
        loops,
        grid=args.grid,
        seq_len=seq_len,
        batch_size=args.batch_size,
        max_batches=args.batches,
        device=device,
        precision=args.precision,
    )
    if not rows:
        raise ValueError(
            f"--loops {args.loops!r} --grid {args.grid}: nothing to evaluate (prefix inference needs r <= K = {model.config.n_loops})"
        )
    if rows[0].tokens == 0:
        raise ValueError(
            f"--data {args.data!r}: no document was evaluated (empty data, or --batches too small for one document)"
        )
    K = model.config.n_loops
    meta = {"checkpoint": str(checkpoint), "data": args.data, "seq_len": seq_len}
    if args.json:
        print(json.dumps({**meta, "train_loops": K, "rows": [asdict(w) for w in rows]}, indent=2))
    else:
        print(f"{checkpoint} on {args.data}: {rows[0].tokens:,} tokens, K = {K}")
        print(depth_table_markdown(rows, K))
    if args.out:
        js, png = write_depth_report(rows, K, args.out, meta)
        if not args.json:
            print(f"wrote {js} and {png}")
    return 0
