"""Training and evaluating ``N⊗R`` models on Mano and p-hop (Looped-Mamba paper, App. C, D).

A task run is one YAML (``configs/tasks/``)::

    task: {name: phop, p: 16, n: 256, dense_target: false}    # or {name: mano, max_length: 24}
    model: mamba2-140m                 # backbone preset / YAML (Mamba-2, Transformer, hybrid)
    model_overrides: {d_model: 256}
    layers: 4                          # N: independently parameterised layers
    loops: 3                           # R: recurrent steps (N⊗R; effective depth N·R)
    blocks_per_layer: 2                # Mamba-2 blocks per "layer" (App. C's proxy for attention + MLP)
    optim: {name: adamw, lr: 2.0e-4, betas: [0.9, 0.98], eps: 1.0e-6, weight_decay: 0.1}
    schedule: {name: cosine, warmup_steps: 2000, min_ratio: 0.1}
    train: {steps: 100000, batch_size: 128, grad_clip: 1.0, precision: bf16, seeds: [0, 1, 2]}

The vocabulary size and the context length of the backbone are set from the task. Each seed trains
into ``OUT/seed_<s>/`` (``model.safetensors``, ``config.json``, ``metrics.jsonl``); ``OUT/results.json``
holds every seed's exact-match accuracy on the deterministic evaluation set and the best one
(the paper's best-of-three protocol: "the run with the maximum average evaluation accuracy").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..dataclass_util import ConfigError, apply_overrides, from_dict, read_yaml_file, to_dict
from ..train.config import OptimConfig, ScheduleConfig

__all__ = [
    "TaskSpec",
    "TaskTrainConfig",
    "TaskRunConfig",
    "load_task_config",
    "build_task_model",
    "task_accuracy",
    "train_task",
    "evaluate_run",
]

DEFAULT_EVAL_COUNT = {"mano": 2000, "phop": 10000}


@dataclass
class TaskSpec:
    """Which task and its parameters (``task`` section)."""

    name: str = "phop"  # "mano" | "phop"
    max_length: int = 10  # Mano L (10, 16, 24 in the paper)
    loss_on: str = "all"  # Mano: "all" tokens of the packed chunk or only "answer" tokens
    p: int = 16  # p-hop hops (16, 32)
    n: int = 256  # p-hop sequence length
    alphabet: int = 4
    dense_target: bool = False  # p-hop: the hop answer of every prefix as target (our CPU-scale option)
    seq_len: int | None = None  # training context: Mano chunk (1024), p-hop row (272); None = the paper's
    eval_count: int | None = None  # None = 2000 (Mano) / 10,000 (p-hop)
    eval_seed: int = 0  # the fixed seed of the deterministic evaluation set

    def validate(self) -> list[str]:
        errs = []
        if self.name not in ("mano", "phop"):
            errs.append(f"name: must be 'mano' or 'phop', got {self.name!r}")
        if self.max_length < 1:
            errs.append(f"max_length: must be >= 1, got {self.max_length}")
        if self.loss_on not in ("all", "answer"):
            errs.append(f"loss_on: must be 'all' or 'answer', got {self.loss_on!r}")
        if self.p < 1 or self.n < self.p + 2:
            errs.append(f"p, n: need p >= 1 and n >= p + 2, got p={self.p}, n={self.n}")
        if self.alphabet < 2:
            errs.append(f"alphabet: must be >= 2, got {self.alphabet}")
        if self.seq_len is not None and self.seq_len < self.min_seq_len():
            errs.append(f"seq_len: {self.seq_len} cannot hold one {self.name} sample ({self.min_seq_len()} tokens)")
        if self.eval_count is not None and self.eval_count < 1:
            errs.append(f"eval_count: must be >= 1, got {self.eval_count}")
        return errs

    def min_seq_len(self) -> int:
        return 2 * self.max_length + 5 if self.name == "mano" else self.n + 4

    @property
    def context(self) -> int:
        """Training context length: ``seq_len`` or the paper's (Mano 1024, p-hop 272 for n = 256)."""
        if self.seq_len is not None:
            return self.seq_len
        if self.name == "mano":
            return 1024
        return 272 if self.n == 256 else self.n + 4  # App. D: 1 + 256 + 3 = 260 tokens in a 272 context

    @property
    def count(self) -> int:
        return self.eval_count or DEFAULT_EVAL_COUNT[self.name]

    def vocab(self):
        from . import mano, phop

        return mano.ManoVocab(self.max_length) if self.name == "mano" else phop.PhopVocab(self.alphabet)

    def stream(self, seed: int):
        from . import mano, phop

        if self.name == "mano":
            return mano.ManoStream(self.max_length, self.context, seed=seed, loss_on=self.loss_on)
        return phop.PhopStream(self.n, self.p, self.alphabet, self.context, seed=seed, dense_target=self.dense_target)

    def eval_set(self, count: int | None = None, seed: int | None = None):
        """``(input_ids, answer_pos, answers)`` of the deterministic evaluation set."""
        from . import mano, phop

        count, seed = self.count if count is None else count, self.eval_seed if seed is None else seed
        if self.name == "mano":
            return mano.eval_batch(mano.generate("eval", count, self.max_length, seed), self.vocab())
        return phop.eval_batch(phop.generate("eval", count, self.n, self.p, self.alphabet, seed), self.vocab())


@dataclass
class TaskTrainConfig:
    """The optimisation loop (``train`` section)."""

    steps: int = 2000
    batch_size: int = 64
    micro_batch_size: int | None = None  # None = batch_size (gradient accumulation otherwise)
    grad_clip: float = 1.0
    precision: str = "auto"  # "fp32" | "bf16" | "auto" (bf16 where it is fast)
    device: str = "auto"
    seeds: list[int] = field(default_factory=lambda: [0])  # best-of-n: one run per seed
    eval_every: int = 0  # accuracy on eval_during instances every N steps (0 = only at the end)
    eval_during: int = 500
    eval_batch_size: int = 256
    log_every: int = 100
    cpu_threads: int | None = None

    def validate(self) -> list[str]:
        errs = []
        if self.steps < 1 or self.batch_size < 1:
            errs.append("steps / batch_size: must be >= 1")
        mb = self.micro_batch_size or self.batch_size
        if mb < 1 or self.batch_size % mb:
            errs.append(f"micro_batch_size: {mb} must divide batch_size={self.batch_size}")
        if self.precision not in ("fp32", "bf16", "auto"):
            errs.append(f"precision: must be 'fp32', 'bf16' or 'auto', got {self.precision!r}")
        if not self.seeds:
            errs.append("seeds: need at least one seed")
        if self.grad_clip < 0 or self.eval_every < 0 or self.eval_during < 1 or self.eval_batch_size < 1:
            errs.append("grad_clip / eval_every must be >= 0, eval_during / eval_batch_size >= 1")
        return errs


@dataclass
class TaskRunConfig:
    """A task run: task, backbone, ``N⊗R``, optimiser, schedule, loop."""

    task: TaskSpec = field(default_factory=TaskSpec)
    model: str = "tiny-mamba2"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    layers: int | None = None  # N (None = the backbone's n_core / blocks_per_layer)
    loops: int | None = None  # R (None = the backbone's n_loops)
    blocks_per_layer: int = 1
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="adamw", lr=2e-3, betas=(0.9, 0.98), eps=1e-6))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="cosine", warmup_fraction=0.1))
    train: TaskTrainConfig = field(default_factory=TaskTrainConfig)

    def validate(self) -> list[str]:
        errs = []
        if self.layers is not None and self.layers < 1 or self.loops is not None and self.loops < 1:
            errs.append(f"layers / loops: N and R must be >= 1, got {self.layers} / {self.loops}")
        if self.blocks_per_layer < 1:
            errs.append(f"blocks_per_layer: must be >= 1, got {self.blocks_per_layer}")
        if not errs and self.task is not None and not self.task.validate():
            try:
                self.model_config()
            except ConfigError as e:
                errs += [f"model: {m}" for m in e.errors]
            except (ValueError, FileNotFoundError) as e:
                errs.append(f"model: {e}")
        return errs

    def model_config(self):
        """The backbone with the task's vocabulary and context and ``N⊗R`` applied."""
        from ..config import load_model_config

        ov = dict(self.model_overrides)
        ov["vocab_size"] = self.task.vocab().size
        ov["max_seq_len"] = max(self.task.context, self.task.min_seq_len())
        if self.layers is not None:
            ov["n_core"] = self.layers * self.blocks_per_layer
        if self.loops is not None:
            ov["n_loops"] = self.loops
        return load_model_config(self.model, ov)

    @property
    def label(self) -> str:
        cfg = self.model_config()
        return f"{cfg.n_core // self.blocks_per_layer}⊗{cfg.n_loops}"


def load_task_config(source, overrides: list[str] | None = None, task: str | None = None) -> TaskRunConfig:
    """Read a task YAML (or dict), apply ``key=value`` overrides, validate (all errors at once)."""
    data = dict(source) if isinstance(source, dict) else read_yaml_file(source, "task config")
    if overrides:
        data = apply_overrides(data, list(overrides))
    cfg = from_dict(TaskRunConfig, data, what="task config")
    if task is not None and cfg.task.name != task:
        raise ConfigError([f"task.name: the config is for {cfg.task.name!r}, the command for {task!r}"], "task config")
    return cfg


def build_task_model(cfg: TaskRunConfig, device="cpu"):
    from ..factory import build

    return build(cfg.model_config()).to(device)


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


@torch.no_grad()
def task_accuracy(
    model,
    eval_set,
    batch_size: int = 256,
    num_loops: int | None = None,
    loop_options: dict | None = None,
    precision: str = "fp32",
) -> dict:
    """Exact match of the argmax at the answer position; with an exit gate also the mean selected
    depth ``iter`` at the answer positions (the executed depth is always the loop count)."""
    ids, pos, answers = eval_set
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct, depth_sum = 0, 0.0
    has_gate = hasattr(model.rule, "exit_summary")
    ac = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if precision == "bf16"
        else torch.autocast(dev.type, enabled=False)
    )
    for a in range(0, ids.shape[0], batch_size):
        x, p, y = ids[a : a + batch_size].to(dev), pos[a : a + batch_size].to(dev), answers[a : a + batch_size].to(dev)
        with ac:
            out = model(x, num_loops=num_loops, loop_options=loop_options)
        rows = torch.arange(x.shape[0], device=dev)
        correct += int((out.logits[rows, p].argmax(-1) == y).sum())
        if has_gate:
            depth_sum += float(model.rule.last_exit["selected_depth"][rows, p].float().sum())
    model.train(was_training)
    r = num_loops or model.config.n_loops
    res = {"accuracy": correct / ids.shape[0], "count": int(ids.shape[0]), "executed_loops": r}
    if has_gate:
        res["iter"] = depth_sum / ids.shape[0]
    return res


def _train_one_seed(cfg: TaskRunConfig, seed: int, out: Path, eval_set, quiet: bool) -> dict:
    from ..train.optim import build_optimizer
    from ..train.schedule import apply_lr, build_lr_lambda
    from ..train.trainer import resolve_precision

    tc = cfg.train
    dev = _device(tc.device)
    precision = resolve_precision(tc.precision, dev)
    torch.manual_seed(seed)
    model = build_task_model(cfg, dev)
    model.train()
    opt = build_optimizer(model, cfg.optim)
    lr_at = build_lr_lambda(cfg.schedule, tc.steps)
    stream = cfg.task.stream(seed)
    mb = tc.micro_batch_size or tc.batch_size
    out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "w")
    small_eval = tuple(t[: tc.eval_during] for t in eval_set)
    t0 = time.perf_counter()
    try:
        for step in range(tc.steps):
            apply_lr(opt, lr_at(step))
            ids, labels = stream.next_batch(tc.batch_size)
            loss_sum = 0.0
            for x, y in zip(ids.split(mb), labels.split(mb)):
                x, y = x.to(dev), y.to(dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(x, labels=y).loss.float()
                (loss * x.shape[0] / tc.batch_size).backward()
                loss_sum += float(loss.detach()) * x.shape[0] / tc.batch_size
            gn = float(
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            )
            if not (math.isfinite(loss_sum) and math.isfinite(gn)):
                raise FloatingPointError(
                    f"seed {seed} step {step + 1}: loss {loss_sum}, grad norm {gn}; lower optim.lr"
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = {
                "step": step + 1,
                "loss": loss_sum,
                "lr": lr_at(step) * cfg.optim.lr,
                "grad_norm": gn,
                "elapsed_s": time.perf_counter() - t0,
            }
            if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < tc.steps:
                rec["eval_accuracy"] = task_accuracy(model, small_eval, tc.eval_batch_size, precision=precision)[
                    "accuracy"
                ]
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            if not quiet and ((step + 1) % tc.log_every == 0 or "eval_accuracy" in rec):
                acc = f" acc {rec['eval_accuracy']:.4f}" if "eval_accuracy" in rec else ""
                print(
                    f"[{cfg.label} seed {seed}] step {step + 1}/{tc.steps} loss {loss_sum:.4f}{acc} "
                    f"({rec['elapsed_s']:.0f}s)",
                    flush=True,
                )
    finally:
        metrics.close()
    train_s = time.perf_counter() - t0
    res = task_accuracy(model, eval_set, tc.eval_batch_size, precision=precision)
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(
        json.dumps({"task_run": to_dict(cfg), "model": to_dict(model.config), "seed": seed}, indent=2)
    )
    return {"seed": seed, **res, "final_loss": loss_sum, "train_time_s": train_s, "precision": precision}


def train_task(cfg: TaskRunConfig, out_dir, quiet: bool = False) -> dict:
    """Train one model per ``train.seeds`` and evaluate each; returns (and writes) the results."""
    from ..info import model_info

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    try:
        eval_set = cfg.task.eval_set()
        info = model_info(cfg.model_config(), seq_len=cfg.task.context)
        runs = [_train_one_seed(cfg, s, out / f"seed_{s}", eval_set, quiet) for s in cfg.train.seeds]
    finally:
        torch.set_num_threads(threads)
    best = max(runs, key=lambda r: r["accuracy"])
    summary = {
        "task": to_dict(cfg.task),
        "model": cfg.label,
        "params": info["params"],
        "forward_flops_per_token": info["forward_flops_per_token"],
        "effective_depth": info["effective_depth"],
        "runs": runs,
        "best_seed": best["seed"],
        "best_accuracy": best["accuracy"],
        "mean_accuracy": sum(r["accuracy"] for r in runs) / len(runs),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    return summary


def load_task_run(run_dir, device="cpu"):
    """``(model, cfg)`` of a seed directory, or of a run directory's best seed."""
    from safetensors.torch import load_file

    from ..checkpoint_io import CheckpointError

    d = Path(run_dir)
    if (d / "results.json").exists() and not (d / "model.safetensors").exists():
        d = d / f"seed_{json.loads((d / 'results.json').read_text())['best_seed']}"
    if not (d / "config.json").exists() or not (d / "model.safetensors").exists():
        raise CheckpointError(
            f"{str(run_dir)!r} is not a `looplm task ... train` run (no config.json / model.safetensors)"
        )
    rec = json.loads((d / "config.json").read_text())
    cfg = from_dict(TaskRunConfig, rec["task_run"], what="task config")
    model = build_task_model(cfg, device)
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    return model.eval(), cfg


def evaluate_run(
    run_dir,
    task: str | None = None,
    count: int | None = None,
    seed: int | None = None,
    num_loops: list[int] | None = None,
    thresholds: list[float] | None = None,
    device: str = "cpu",
    png: str | None = None,
) -> dict:
    """Accuracy of a trained run on the deterministic evaluation set; ``num_loops``: the fixed-loop
    ablation (forced ``r``); ``thresholds``: the exit-gate sweep (accuracy and selected depth ``iter``;
    the executed depth stays ``R``). ``png``: the Figure-1-style plot of both."""
    from ..eval.threshold import plot_sweep, sweep

    errs = []
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        errs.append(f"count (--count): must be an integer >= 1 (default: the run's), got {count!r}")
    bad_loops = [r for r in num_loops or [] if isinstance(r, bool) or not isinstance(r, int) or r < 1]
    if bad_loops:
        errs.append(f"num_loops (--loops): every forced loop count must be an integer >= 1, got {bad_loops}")
    bad_q = [q for q in thresholds or [] if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1]
    if bad_q:
        errs.append(f"thresholds (--thresholds): every exit threshold q must be in [0, 1], got {bad_q}")
    if errs:
        raise ConfigError(errs, "task eval arguments")
    model, cfg = load_task_run(run_dir, device)
    if task is not None and cfg.task.name != task:
        raise ValueError(f"{run_dir} is a {cfg.task.name!r} run, not {task!r}")
    ev = cfg.task.eval_set(count, seed)

    def metric(m, num_loops=None, loop_options=None):
        return task_accuracy(m, ev, num_loops=num_loops, loop_options=loop_options)

    res: dict = {"run": str(run_dir), "model": cfg.label, "task": to_dict(cfg.task), "default": metric(model)}
    rows = sweep(model, metric, thresholds or [], num_loops or [])
    if num_loops:
        res["fixed_loops"] = [r for r in rows if r["setting"] == "fixed"]
    if thresholds:
        res["thresholds"] = [r for r in rows if r["setting"] == "threshold"]
    if png and rows:
        plot_sweep(rows, png, "accuracy", title=f"{cfg.task.name} {cfg.label}")
    res["rows"] = rows
    return res
