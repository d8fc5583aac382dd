"""The tables (markdown, :data:`TABLES`) and plots of ``looplm bench adaptive``."""

from __future__ import annotations


def _md(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "| " + " | ".join("---:" if c[2] else "---" for c in cols) + " |"
    lines = [head, sep]
    for r in rows:
        vals = []
        for key, _, fmt in cols:
            v = r.get(key)
            vals.append(
                ""
                if v is None
                else (format(v, fmt) if fmt and isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
            )
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


TABLES = {
    "quality": [
        ("criterion", "criterion", ""),
        ("threshold", "ε", "g"),
        ("kv", "kv", ""),
        ("selected_depth", "selected", ".2f"),
        ("executed_depth", "executed", ".2f"),
        ("flops_ratio", "FLOPs / full", ".3f"),
        ("agreement", "greedy agree", ".3f"),
        ("kl_to_full", "KL(full‖exit)", ".4f"),
        ("ppl", "PPL", ".3f"),
        ("ppl_full", "PPL full", ".3f"),
    ],
    "timing": [
        ("dtype", "dtype", ""),
        ("batch", "B", "d"),
        ("criterion", "criterion", ""),
        ("threshold", "ε / q", "g"),
        ("kv", "kv", ""),
        ("schedule", "schedule", ""),
        ("selected_depth", "selected", ".2f"),
        ("executed_depth", "executed", ".2f"),
        ("batch_depth", "core passes / step", ".2f"),
        ("executed_ratio", "executed / K", ".3f"),
        ("time_ratio", "time / full", ".3f"),
        ("full_ms_per_token", "full ms/tok", ".2f"),
        ("target_met", "≤ 1.1 × executed", ""),
    ],
    "frontier": [
        ("criterion", "criterion", ""),
        ("threshold", "ε", "g"),
        ("kv", "kv", ""),
        ("executed_depth", "executed", ".2f"),
        ("ppl", "PPL", ".3f"),
        ("ms_per_token", "ms/token", ".2f"),
        ("time_ratio", "time / full", ".3f"),
    ],
    "kv_bytes": [
        ("kv", "policy", ""),
        ("bytes_per_token", "KV bytes / token", ",.0f"),
        ("ratio", "vs per-loop", ".3f"),
    ],
    "prefill": [
        ("dtype", "dtype", ""),
        ("batch", "B", "d"),
        ("tokens", "T", "d"),
        ("criterion", "criterion", ""),
        ("threshold", "ε", "g"),
        ("kv", "kv", ""),
        ("selected_depth", "selected", ".2f"),
        ("executed_ratio", "executed / K", ".3f"),
        ("computed_ratio", "computed / K", ".3f"),
        ("ppl", "PPL", ".3f"),
        ("ppl_full", "PPL full", ".3f"),
        ("full_ms", "full ms", ".1f"),
        ("ms", "exit ms", ".1f"),
        ("time_ratio", "time / full", ".3f"),
        ("target_met", "≤ 1.1 × executed", ""),
        ("speedup_vs_sequential", "vs token by token", ".1f"),
        ("max_logit_diff", "max |Δ logit|", ".1e"),
    ],
    "speculative": [
        ("dtype", "dtype", ""),
        ("batch", "B", "d"),
        ("draft_loops", "r_d", "d"),
        ("k", "k", "d"),
        ("draft_exit", "draft exit", ""),
        ("mean_draft_depth", "draft depth", ".2f"),
        ("verify_start", "verify from loop", ".2f"),
        ("draft_agreement", "draft agrees", ".3f"),
        ("acceptance", "accepted / drafted", ".3f"),
        ("tokens_per_round", "tokens / round", ".2f"),
        ("full_ms_per_token", "full ms/tok", ".2f"),
        ("draft_ms_per_round", "draft ms/round", ".2f"),
        ("verify_ms_per_round", "verify ms/round", ".2f"),
        ("speedup", "speed-up", ".3f"),
        ("free_verify_bound", "bound (free verify)", ".3f"),
        ("greedy_identical", "== full greedy", ""),
    ],
    # `--compare-reclaim`: the same rows' cache sizes and the run that keeps rejected drafts' columns
    "reclaim": [
        ("dtype", "dtype", ""),
        ("batch", "B", "d"),
        ("draft_loops", "r_d", "d"),
        ("k", "k", "d"),
        ("draft_exit", "draft exit", ""),
        ("tokens_per_round", "tokens / round", ".2f"),
        ("keep_columns", "columns kept", "d"),
        ("cache_columns", "columns reclaimed", "d"),
        ("peak_columns", "peak used", "d"),
        ("compactions", "compactions", "d"),
        ("speedup_keep", "speed-up kept", ".3f"),
        ("speedup", "speed-up reclaimed", ".3f"),
        ("reclaim_gain", "reclaimed / kept", ".3f"),
        ("greedy_identical", "== full greedy", ""),
    ],
    "task": [
        ("setting", "setting", ""),
        ("value", "q / r", ""),
        ("kv", "kv", ""),
        ("accuracy", "accuracy", ".4f"),
        ("selected_depth", "selected", ".2f"),
        ("executed_depth", "executed", ".2f"),
        ("executed_depth_ans", "executed @ans", ".2f"),
        ("time_ratio", "time / full", ".3f"),
    ],
    "scale": [
        ("mixer", "mixer", ""),
        ("d_model", "d", "d"),
        ("dtype", "dtype", ""),
        ("batch", "B", "d"),
        ("schedule", "schedule", ""),
        ("executed_ratio", "executed / K", ".3f"),
        ("batch_depth", "core passes / step", ".2f"),
        ("time_ratio", "time / full", ".3f"),
        ("full_ms_per_token", "full ms/tok", ".2f"),
        ("target_met", "≤ 1.1 × executed", ""),
    ],
}


def plot_frontier(rows: list[dict], path, metric: str, title: str, xkey: str = "executed_depth") -> None:
    """Metric against executed depth, one line per KV policy, each point labelled with its time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("kv", "-"), []).append(r)
    for kv, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[xkey])
        ax.plot(
            [r[xkey] for r in rs],
            [r[metric] for r in rs],
            "o-" if kv != "-" else "s",
            label=f"kv={kv}" if kv != "-" else "full depth",
        )
        for r in rs:
            if r.get("time_ratio") is not None:
                ax.annotate(
                    f"{r['time_ratio']:.2f}×t",
                    (r[xkey], r[metric]),
                    textcoords="offset points",
                    xytext=(3, 3),
                    fontsize=6,
                )
    ax.set_xlabel("executed loops per token (the work that ran)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_task(rows: list[dict], path, title: str) -> None:
    """Accuracy against executed loops: the gate's q sweep as one line per KV policy (kv='full' runs every
    loop: left out, it is the table's output-selection reference), forced depths and full depth as markers;
    the first policy's points labelled with their time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.4, 3.7))
    for kv in dict.fromkeys(r["kv"] for r in rows if r["setting"] == "gate"):
        if kv == "full":
            continue
        rs = sorted((r for r in rows if r["setting"] == "gate" and r["kv"] == kv), key=lambda r: r["executed_depth"])
        ax.plot([r["executed_depth"] for r in rs], [r["accuracy"] for r in rs], "o-", label=f"gate q sweep, kv={kv}")
        for r in rs:
            if r.get("time_ratio") is not None:
                ax.annotate(
                    f"q={r['value']}: {r['time_ratio']:.2f}×t",
                    (r["executed_depth"], r["accuracy"]),
                    textcoords="offset points",
                    xytext=(3, -9),
                    fontsize=6,
                )
    fx = [r for r in rows if r["setting"] == "replay" and r["kv"] == rows[1]["kv"]]
    ax.plot([r["executed_depth"] for r in fx], [r["accuracy"] for r in fx], "s", color="gray", label="forced depth r")
    full = [r for r in rows if r["setting"] == "full"]
    ax.plot(
        [r["executed_depth"] for r in full],
        [r["accuracy"] for r in full],
        "*",
        ms=10,
        color="black",
        label="full depth",
    )
    ax.set_xlabel("executed loops per token (the work that ran)")
    ax.set_ylabel("accuracy at <ans>")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
