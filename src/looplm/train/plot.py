"""Training curves from ``metrics.jsonl``: loss (+ validation), learning rate, throughput.

``looplm plot RUN_DIR`` writes ``RUN_DIR/curves.png`` (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["plot_run"]


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, smooth: int = 0) -> Path:
    """Plot ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/curves.png``); return the path.

    Args:
        smooth: width of a trailing moving average drawn over the training loss (0 = auto:
            about 1/50 of the run, at least 1).
    """
    from .metrics import read_metrics

    run_dir = Path(run_dir)
    records = [
        r
        for r in read_metrics(run_dir)  # a wrong path is said before matplotlib is needed
        if isinstance(r, dict) and isinstance(r.get("step"), int) and not r.get("skipped")
    ]
    if not records:
        where = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
        raise ValueError(
            f"{where} has no training steps to plot (no JSON lines with a 'step'); give a `looplm train` "
            "output directory"
        )
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'looplm[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    loss = [r.get("loss") for r in records]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="train loss")
    w = smooth or max(1, len(loss) // 50)
    if w > 1:
        sm, acc = [], []
        for v in loss:
            acc.append(v)
            if len(acc) > w:
                acc.pop(0)
            sm.append(sum(acc) / len(acc))
        ax.plot(steps, sm, lw=1.5, label=f"train loss (avg {w})")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(steps, [r.get("lr") for r in records], label="AdamW lr")
    if any("muon_lr" in r for r in records):
        ax.plot(steps, [r.get("muon_lr") for r in records], "--", label="Muon lr")
    ax.set_xlabel("step")
    ax.set_title("learning rate")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[2]
    ax.plot(steps, [r.get("tokens_per_s") for r in records], lw=0.8)
    ax.set_xlabel("step")
    ax.set_title("throughput (tokens/s)")
    ax.grid(alpha=0.3)

    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
