"""``looplm grid``: iso-parameter / iso-FLOPs grids of ``N⊗R`` models (Looped-Mamba Tab. 1-3, 5).

A grid file lists backbones and ``N⊗R`` pairs::

    kind: lm                                    # lm: language modelling (`looplm train` config)
    train_config: configs/train/looped-mamba-cosine.yaml
    groups:
      - {name: Mamba-2, model: mamba2-140m, pairs: [[6, 1], [6, 4], [12, 1], [12, 2], [24, 1]]}
      - {name: LLaMA-2 Transformer, model: llama2-140m, pairs: [[6, 1], [6, 4], [12, 1], [12, 2], [24, 1]]}

    kind: task                                  # task: Mano / p-hop (`looplm task ... train` config)
    task_config: configs/tasks/phop-p16.yaml
    groups: [{name: Mamba-2, pairs: [[12, 1], [1, 1], [1, 6], ...]}]   # model: defaults to the task config's

``looplm grid FILE`` prints the table in the papers' layout — ``Base (N⊗1)`` / ``Loop (N⊗R)``, the
relative ``Params / FLOPs`` column (``N× / NR×``), exact parameters and forward FLOPs per token
(:func:`looplm.info.model_info`, meta device) — with empty metric columns; ``--run --out DIR`` trains
every row (``--set`` overrides go to every run, e.g. a scaled-down ``train.steps``) and fills them:
validation PPL for ``lm`` grids, best-of-seeds exact-match accuracy for ``task`` grids.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..dataclass_util import ConfigError, from_dict, read_yaml_file

__all__ = ["GridGroup", "GridConfig", "load_grid", "grid_rows", "format_table", "run_grid", "register"]


@dataclass
class GridGroup:
    name: str = "Mamba-2"
    model: str | None = None  # backbone preset / YAML (task grids: None = the task config's model)
    pairs: list[list[int]] = field(default_factory=list)  # [[N, R], ...]
    overrides: dict = field(default_factory=dict)  # model config overrides for every row of the group

    def validate(self) -> list[str]:
        errs = []
        if not self.pairs:
            errs.append(f"groups[{self.name}].pairs: list at least one [N, R] pair")
        for p in self.pairs:
            if len(p) != 2 or any(not isinstance(v, int) or v < 1 for v in p):
                errs.append(f"groups[{self.name}].pairs: {p} is not a pair [N, R] of positive integers")
        return errs


@dataclass
class GridConfig:
    kind: str = "lm"  # "lm" | "task"
    train_config: str | None = None  # lm: the `looplm train` YAML each row trains with
    task_config: str | None = None  # task: the `looplm task ... train` YAML
    blocks_per_layer: int | None = None  # None = the task config's (1 for lm grids)
    groups: list[GridGroup] = field(default_factory=list)

    def validate(self) -> list[str]:
        errs = []
        if self.kind not in ("lm", "task"):
            errs.append(f"kind: must be 'lm' or 'task', got {self.kind!r}")
        if self.kind == "task" and not self.task_config:
            errs.append("task_config: a task grid needs the task YAML its rows train with")
        if self.kind == "lm" and any(g.model is None for g in self.groups):
            errs.append("groups: every group of an lm grid needs a model (backbone preset)")
        if not self.groups:
            errs.append("groups: list at least one group of [N, R] pairs")
        return errs


def load_grid(path) -> GridConfig:
    data = read_yaml_file(path, "grid file")
    base = Path(path).parent
    for key in ("train_config", "task_config"):  # relative to the grid file when it exists there
        v = data.get(key)
        if isinstance(v, str) and not Path(v).exists() and (base / v).exists():
            data[key] = str(base / v)
    return from_dict(GridConfig, data, what="grid file")


def _task_cfg(grid: GridConfig, group: GridGroup, N: int, R: int, sets: list[str]):
    from .train import load_task_config

    ov = list(sets) + [f"layers={N}", f"loops={R}"]
    if group.model is not None:
        ov.append(f"model={group.model}")
    cfg = load_task_config(grid.task_config, ov)
    if group.overrides:
        cfg.model_overrides = {**cfg.model_overrides, **group.overrides}
    if grid.blocks_per_layer is not None:
        cfg.blocks_per_layer = grid.blocks_per_layer
    return cfg


def grid_rows(grid: GridConfig, sets: list[str] | None = None) -> list[dict]:
    """One row per (group, N, R): label, relative and exact parameters / FLOPs (no training)."""
    from ..info import model_info

    rows = []
    for g in grid.groups:
        for N, R in g.pairs:
            if grid.kind == "task":
                cfg = _task_cfg(grid, g, N, R, sets or [])
                info = model_info(cfg.model_config(), seq_len=cfg.task.context)
            else:
                bpl = grid.blocks_per_layer or 1
                info = model_info(g.model, overrides={**g.overrides, "n_core": N * bpl, "n_loops": R})
            rows.append(
                {
                    "group": g.name,
                    "N": N,
                    "R": R,
                    "model": f"{'Base' if R == 1 else 'Loop'} ({N}⊗{R})",
                    "relative": f"{N}×/{N * R}×",
                    "params": info["params"],
                    "non_embedding_params": info["non_embedding_params"],
                    "flops_per_token": info["forward_flops_per_token"],
                    "effective_depth": info["effective_depth"],
                }
            )
    return rows


def format_table(rows: list[dict], metrics: list[str]) -> str:
    """Markdown in the Table 3 / Table 5 layout (one block per group)."""
    head = ["Model", "Params / FLOPs", "params", "FLOPs/token", *metrics]
    out = ["| " + " | ".join(head) + " |", "| --- | --- | ---: | ---: |" + " ---: |" * len(metrics)]
    group = None
    for r in rows:
        if r["group"] != group:
            group = r["group"]
            out.append(f"| **{group}** |" + " |" * (len(head) - 1))
        vals = []
        for m in metrics:
            v = r.get(m)
            vals.append("" if v is None else (f"{v:.2%}" if m == "accuracy" else f"{v:.2f}"))
        out.append(
            f"| {r['model']} | {r['relative']} | {r['params']:,} | {r['flops_per_token']:,} | "
            + " | ".join(vals)
            + " |"
        )
    return "\n".join(out)


def run_grid(grid: GridConfig, out_dir, sets: list[str] | None = None, quiet: bool = False) -> list[dict]:
    """Train every row into ``OUT/<group>-<N>x<R>`` and add its metric (accuracy or val PPL)."""
    out = Path(out_dir)
    rows = grid_rows(grid, sets)
    groups = {g.name: g for g in grid.groups}
    for r in rows:
        g = groups[r["group"]]
        run_dir = out / f"{g.name.replace(' ', '_').replace('/', '_')}-{r['N']}x{r['R']}"
        if grid.kind == "task":
            from .train import train_task

            res = train_task(_task_cfg(grid, g, r["N"], r["R"], sets or []), run_dir, quiet=quiet)
            r.update(
                accuracy=res["best_accuracy"],
                seeds=[x["accuracy"] for x in res["runs"]],
                train_time_s=sum(x["train_time_s"] for x in res["runs"]),
            )
        else:
            from ..train import Trainer, load_train_config

            ov = list(sets or []) + [
                f"model={g.model}",
                f"model_overrides.n_core={r['N'] * (grid.blocks_per_layer or 1)}",
                f"model_overrides.n_loops={r['R']}",
            ]
            ov += [f"model_overrides.{k}={json.dumps(v)}" for k, v in g.overrides.items()]
            res = Trainer(load_train_config(grid.train_config, ov), run_dir, quiet=quiet).fit()
            r.update(ppl=res.get("val_ppl"), train_time_s=res.get("train_time_s"))
        if not quiet:
            print(f"{r['group']} {r['model']}: " + json.dumps({k: r.get(k) for k in ("accuracy", "ppl")}), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(rows, indent=2))
    return rows


def _cmd_grid(args) -> int:
    grid = load_grid(args.file)
    metrics = ["accuracy"] if grid.kind == "task" else ["ppl"]
    if args.run:
        if not args.out:
            raise ConfigError(["--out: --run needs a directory for the runs"], "grid command")
        from ..train.trainer import TrainingInterrupted

        try:
            rows = run_grid(grid, args.out, args.set or [], quiet=args.quiet)
        except TrainingInterrupted as e:  # SIGTERM / SIGINT: the row's checkpoint is written; rerun to resume
            print(e, file=sys.stderr)
            return e.exit_code
    else:
        rows = grid_rows(grid, args.set or [])
    print(json.dumps(rows, indent=2, ensure_ascii=False) if args.json else format_table(rows, metrics))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("grid", help="iso-parameter / iso-FLOPs grid of N⊗R models: table, or train every row")
    p.add_argument("file", help="grid YAML (configs/grids/...)")
    p.add_argument("--run", action="store_true", help="train every row and fill the metric column")
    p.add_argument("--out", default=None, help="directory for the runs (with --run)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override every row's run config (repeatable)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_grid)
