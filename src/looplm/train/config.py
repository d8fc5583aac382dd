"""``TrainConfig``: every setting of a training run, as typed, validated, nested dataclasses.

A run is described by one YAML file plus ``--set key=value`` overrides::

    model: tiny-llama                # preset name or path to a model YAML
    model_overrides: {n_loops: 4}    # dotted keys allowed: {"attention.n_heads": 2}
    data: {source: stdlib, seq_len: 128}        # looplm.data.config.DataConfig
    optim: {name: muon_adamw, lr: 3.0e-3, muon_lr: 3.0e-3}
    schedule: {name: wsd}
    train: {global_batch_size: 16, micro_batch_size: 8, max_steps: 300}
    eval: {every: 100, batches: 4}
    checkpoint: {every: 100, keep_last: 2}
    logging: {tensorboard: true}

:func:`load_train_config` reads the YAML, applies the overrides and builds the dataclasses with
:func:`looplm.dataclass_util.from_dict`, so unknown / misspelled keys, wrong types and every
``validate()`` message (including the model config's) come back together in one ``ConfigError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.config import DataConfig
from ..dataclass_util import ConfigError, apply_overrides, from_dict, read_yaml_file, refuse_empty_yaml, to_dict

__all__ = [
    "OptimConfig",
    "ScheduleConfig",
    "RandomLoopsConfig",
    "TrainLoopConfig",
    "EvalConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "TrainConfig",
    "load_train_config",
    "ConfigError",
]


@dataclass
class OptimConfig:
    """Optimizer recipe.

    ``muon_adamw`` (recurrence-effectiveness paper): Muon for hidden 2-D weight matrices, AdamW for
    embeddings, head, norms, vectors and scalars (see ``looplm.train.optim``). ``adamw`` (Looped-Mamba
    paper): AdamW for everything.

    ``muon_adjust_lr`` is ``torch.optim.Muon``'s ``adjust_lr_fn``: ``"match_rms_adamw"`` (Moonshot:
    update RMS matched to AdamW's, so ``muon_lr`` can be of the same order as ``lr``) or
    ``"original"`` (Keller Jordan's ``sqrt(max(1, rows/cols))`` scaling; typical ``muon_lr`` ~ 0.02).
    """

    name: str = "muon_adamw"  # "muon_adamw" | "adamw"
    lr: float = 3e-3  # peak LR of the AdamW groups
    muon_lr: float = 3e-3  # peak LR of the Muon groups
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled; not applied to norms, 1-D params and _no_weight_decay params
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True  # Muon Nesterov momentum
    ns_steps: int = 5  # Muon Newton-Schulz iterations
    muon_adjust_lr: str | None = "match_rms_adamw"  # "match_rms_adamw" | "original"
    foreach: bool | None = None  # AdamW's foreach implementation (None = torch's choice)
    # AdamW's fused kernel (one pass over each parameter, 5x faster than the per-tensor loop on a
    # 2-core CPU at 128M parameters). None = on for plain CPU / CUDA tensors, off for DTensors (FSDP2)
    fused: bool | None = None

    def validate(self) -> list[str]:
        errs = []
        if self.name not in ("muon_adamw", "adamw"):
            errs.append(f"name: must be 'muon_adamw' or 'adamw', got {self.name!r}")
        if not (math.isfinite(self.lr) and math.isfinite(self.muon_lr)) or self.lr < 0 or self.muon_lr < 0:
            errs.append(f"lr / muon_lr: must be finite numbers >= 0, got {self.lr} / {self.muon_lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            errs.append(f"betas: need two values in [0, 1), got {list(self.betas)}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            errs.append(f"eps: must be a finite number > 0, got {self.eps}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            errs.append(f"weight_decay: must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            errs.append(f"momentum: must be in [0, 1), got {self.momentum}")
        if self.ns_steps < 1:
            errs.append(f"ns_steps: must be >= 1, got {self.ns_steps}")
        if self.muon_adjust_lr not in (None, "original", "match_rms_adamw"):
            errs.append(f"muon_adjust_lr: must be 'original' or 'match_rms_adamw', got {self.muon_adjust_lr!r}")
        if self.fused and self.foreach:
            errs.append("fused / foreach: AdamW takes one implementation; set at most one of them to true")
        return errs


@dataclass
class ScheduleConfig:
    """LR schedule (multiplier of each group's peak LR; see ``looplm.train.schedule``).

    * ``wsd``: warmup ``warmup_fraction`` (paper: 5%) linearly from 0, stable, linear decay over the
      last ``decay_fraction`` (10%) of updates down to ``min_ratio`` (0.1) × peak.
    * ``cosine``: warmup (Looped-Mamba: ratio 0.1), then half-cosine to ``min_ratio`` (0.1) × peak.
    * ``constant``: warmup, then constant.

    ``warmup_steps`` (an update count) overrides ``warmup_fraction`` when set.
    """

    name: str = "wsd"  # "wsd" | "cosine" | "constant"
    warmup_fraction: float = 0.05
    warmup_steps: int | None = None
    decay_fraction: float = 0.1  # WSD only
    min_ratio: float = 0.1  # WSD terminal ratio / cosine floor

    def validate(self) -> list[str]:
        errs = []
        if self.name not in ("wsd", "cosine", "constant"):
            errs.append(f"name: must be 'wsd', 'cosine' or 'constant', got {self.name!r}")
        if not 0 <= self.warmup_fraction <= 1:
            errs.append(f"warmup_fraction: must be in [0, 1], got {self.warmup_fraction}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            errs.append(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.decay_fraction <= 1:
            errs.append(f"decay_fraction: must be in [0, 1], got {self.decay_fraction}")
        if self.name == "wsd" and self.warmup_steps is None and self.warmup_fraction + self.decay_fraction > 1:
            errs.append("warmup_fraction + decay_fraction: exceed 1 (no stable phase left)")
        if not 0 <= self.min_ratio <= 1:
            errs.append(f"min_ratio: must be in [0, 1], got {self.min_ratio}")
        return errs


@dataclass
class RandomLoopsConfig:
    """Randomised loop counts: each step (or each sequence, ``per_sequence``) draws ``r`` (same on every
    rank) and back-propagates through the last ``grad_loops`` iterations only (truncated BPTT, Huginn/Parcae style;
    ``null`` = through all ``r``)."""

    min: int = 1
    max: int = 4
    grad_loops: int | None = None
    # per_sequence: each sequence of the batch draws its own depth (Parcae's per-sequence sampling; the
    # model takes a [B] num_loops). distribution: "uniform" U{min..max}, or "poisson": max(min, Poisson(mean))
    # clipped to max (Parcae's "poisson-truncated" scheme).
    per_sequence: bool = False
    distribution: str = "uniform"
    mean: float | None = None

    def validate(self) -> list[str]:
        errs = []
        if self.distribution not in ("uniform", "poisson"):
            errs.append(f"distribution: must be 'uniform' or 'poisson', got {self.distribution!r}")
        elif self.distribution == "poisson" and (self.mean is None or not 0 < self.mean <= 1e6):
            # (torch.poisson draws in float32: a mean past it overflows at the first step)
            errs.append(f"mean: the poisson distribution needs a mean in (0, 1e6], got {self.mean}")
        if self.min < 1:
            errs.append(f"min: must be >= 1, got {self.min}")
        if self.max < self.min:
            errs.append(f"max: must be >= min ({self.min}), got {self.max}")
        if self.grad_loops is not None and self.grad_loops < 1:
            errs.append(f"grad_loops: must be >= 1 or null, got {self.grad_loops}")
        return errs


MAX_CPU_THREADS = 1024  # train.cpu_threads: more than any CPU has cores, fewer than a process may start


@dataclass
class TrainLoopConfig:
    """The optimisation loop (section ``train``)."""

    global_batch_size: int = 16  # sequences per optimizer update, summed over ranks
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    max_steps: int = 100  # optimizer updates
    grad_clip: float = 1.0  # global L2 norm clipping; 0 = no clipping (norm still logged)
    precision: str = "bf16"  # "bf16" (autocast, fp32 master weights) | "fp32" | "auto" (bf16 where it is fast)
    seed: int = 42
    device: str = "auto"  # "auto" (cuda if available) | "cpu" | "cuda"
    cpu_threads: int | None = None  # torch.set_num_threads on CPU (None = torch's default)
    cpu_malloc: bool | str = (
        "auto"  # keep freed memory for reuse (looplm.utils.cpu_malloc): true | false | "auto" (CPU + glibc)
    )
    activation_checkpointing: bool = False  # recompute each loop iteration in backward
    compile: bool | str = (
        "auto"  # compile every block (looplm.parallel.compile_blocks): true | false | "auto" (see resolve_compile)
    )
    cpu_gemm: bool | str = (
        "auto"  # bf16 Linear products in the measured fastest split (looplm.kernels.gemm): true | false | "auto" (CPU + bf16)
    )
    num_grad_loops: int | None = None  # fixed truncated BPTT: backprop through the last m loops only
    random_loops: RandomLoopsConfig | None = None
    nan_policy: str = "stop"  # "stop" | "skip": what to do on a non-finite loss / grad norm
    max_consecutive_skips: int = 5  # nan_policy skip: stop with an error after this many skipped updates in a row
    parallel: str = "ddp"  # "ddp" | "fsdp" | "none" (only used with more than one process)
    fsdp_granularity: str = "core"  # "core" (shard core blocks + root) | "root" (one unit)
    debug_nan_at_step: int | None = None  # testing aid: make the loss NaN at this 1-based step
    debug_nan_steps: int = 1  # testing aid: ... and at the steps after it, this many steps in all
    debug_step_sleep_s: float = 0.0  # testing aid: sleep after every step (e.g. to kill a run mid-way)
    init_from: str | None = (
        None  # start from these model weights (checkpoint or run dir); new rule parameters keep their init
    )
    freeze: list[str] = field(
        default_factory=list
    )  # fnmatch patterns of parameter names: requires_grad off, not in the optimizer
    init_map: dict[str, list[int]] | None = (
        None  # with init_from: pretrained layers -> {prelude, core, coda} (looplm.hf.retrofit)
    )
    loop_schedule: list[list[int]] | None = (
        None  # [[step, loops], ...]: the loop count from each step on (looplm.hf.retrofit)
    )
    allow_model_change: bool = (
        False  # resume a checkpoint whose model config differs (refused otherwise; recorded in run.json)
    )

    def validate(self) -> list[str]:
        errs = []
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            errs.append("global_batch_size / micro_batch_size: must be >= 1")
        elif self.global_batch_size % self.micro_batch_size:
            errs.append(
                f"global_batch_size: {self.global_batch_size} is not a multiple of micro_batch_size={self.micro_batch_size}"
            )
        if self.max_steps < 1:
            errs.append(f"max_steps: must be >= 1, got {self.max_steps}")
        if not math.isfinite(self.grad_clip) or self.grad_clip < 0:  # NaN / inf would switch clipping off
            errs.append(f"grad_clip: must be a finite number >= 0 (0 = off), got {self.grad_clip}")
        if self.precision not in ("bf16", "fp32", "auto"):
            errs.append(f"precision: must be 'bf16', 'fp32' or 'auto' (fp16 is not supported), got {self.precision!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            errs.append(f"device: must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.compile not in (True, False, "auto"):
            errs.append(f"compile: must be true, false or 'auto', got {self.compile!r}")
        if self.cpu_malloc not in (True, False, "auto"):
            errs.append(f"cpu_malloc: must be true, false or 'auto', got {self.cpu_malloc!r}")
        if self.cpu_gemm not in (True, False, "auto"):
            errs.append(f"cpu_gemm: must be true, false or 'auto', got {self.cpu_gemm!r}")
        if self.nan_policy not in ("stop", "skip"):
            errs.append(f"nan_policy: must be 'stop' or 'skip', got {self.nan_policy!r}")
        if self.max_consecutive_skips < 1:
            errs.append(f"max_consecutive_skips: must be >= 1, got {self.max_consecutive_skips}")
        if not math.isfinite(self.debug_step_sleep_s) or self.debug_step_sleep_s < 0:
            errs.append(f"debug_step_sleep_s: must be a finite number >= 0, got {self.debug_step_sleep_s}")
        if self.debug_nan_steps < 1:
            errs.append(f"debug_nan_steps: must be >= 1, got {self.debug_nan_steps}")
        if self.parallel not in ("ddp", "fsdp", "none"):
            errs.append(f"parallel: must be 'ddp', 'fsdp' or 'none', got {self.parallel!r}")
        if self.fsdp_granularity not in ("core", "root"):
            errs.append(f"fsdp_granularity: must be 'core' or 'root', got {self.fsdp_granularity!r}")
        if self.num_grad_loops is not None and self.num_grad_loops < 1:
            errs.append(f"num_grad_loops: must be >= 1 or null, got {self.num_grad_loops}")
        if self.num_grad_loops is not None and self.random_loops is not None:
            errs.append("num_grad_loops: set random_loops.grad_loops instead when random_loops is on")
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes a 64-bit integer
            errs.append(f"seed: must be in [0, 2**63), got {self.seed}")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= MAX_CPU_THREADS:
            # torch starts that many threads at the first step: past what a process can start it dies there
            errs.append(f"cpu_threads: must be in [1, {MAX_CPU_THREADS}] or null, got {self.cpu_threads}")
        if any(not isinstance(f, str) or not f for f in self.freeze):
            errs.append(f"freeze: must be a list of parameter-name patterns (e.g. 'core.*'), got {self.freeze!r}")
        return errs


@dataclass
class EvalConfig:
    """Validation loss / perplexity during training (on the data config's ``val`` split)."""

    every: int = 0  # optimizer updates between evaluations; 0 = only at the end
    batches: int = 4  # validation batches per evaluation (the same ones each time)
    batch_size: int | None = None  # sequences per validation batch (global); None = micro_batch_size x processes
    at_end: bool = True

    def validate(self) -> list[str]:
        errs = []
        if self.every < 0:
            errs.append(f"every: must be >= 0 (0 = only at the end), got {self.every}")
        if self.batches < 1:
            errs.append(f"batches: must be >= 1, got {self.batches}")
        if self.batch_size is not None and self.batch_size < 1:
            errs.append(f"batch_size: must be >= 1 or null, got {self.batch_size}")
        return errs


@dataclass
class CheckpointConfig:
    """Checkpoints under ``OUT/ckpt/step_XXXXXX/`` (see ``looplm.train.checkpoint``)."""

    every: int = 0  # optimizer updates between checkpoints; 0 = only at the end
    keep_last: int = 3  # complete checkpoints to keep (older ones are deleted); 0 = keep all
    at_end: bool = True
    verify: bool = True  # check the SHA-256 of every file on load

    def validate(self) -> list[str]:
        errs = []
        if self.every < 0:
            errs.append(f"every: must be >= 0 (0 = only at the end), got {self.every}")
        if self.keep_last < 0:
            errs.append(f"keep_last: must be >= 0 (0 = keep all), got {self.keep_last}")
        return errs


@dataclass
class LoggingConfig:
    """Where metrics go. ``OUT/metrics.jsonl`` is always written (one line per optimizer update)."""

    log_every: int = 10  # console lines (when the progress bar is off) every N updates
    progress_bar: bool = True  # tqdm bar with ETA (rank 0)
    tensorboard: bool = True  # OUT/tensorboard/ event files (if the tensorboard package is installed)
    wandb: bool = False  # Weights & Biases (if installed)
    wandb_project: str = "looplm"
    wandb_run_name: str | None = None

    def validate(self) -> list[str]:
        return [] if self.log_every >= 1 else [f"log_every: must be >= 1, got {self.log_every}"]


@dataclass
class TrainConfig:
    """A whole training run: model, data, optimizer, schedule, loop, eval, checkpoints, logging."""

    model: str = "tiny-llama"  # preset name or path to a model YAML
    model_overrides: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> list[str]:
        """Cross-section checks; the model config is resolved (not built) so its errors show too."""
        errs: list[str] = []
        try:
            refuse_empty_yaml(self.model, "model config")
            mcfg = self.model_config()
        except ConfigError as e:
            errs += [f"model: {m}" for m in e.errors]
            return errs
        except (ValueError, FileNotFoundError) as e:
            return [f"model: {e}"]
        if self.data is not None and self.data.seq_len > mcfg.max_seq_len:
            errs.append(f"data.seq_len: {self.data.seq_len} exceeds the model's max_seq_len={mcfg.max_seq_len}")
        rl = self.train.random_loops if self.train is not None else None
        if rl is not None and rl.grad_loops is not None and rl.grad_loops > rl.max:
            errs.append(f"train.random_loops.grad_loops: {rl.grad_loops} exceeds random_loops.max={rl.max}")
        if self.train is not None and (self.train.init_map is not None or self.train.loop_schedule is not None):
            from ..hf.retrofit import validate_retrofit  # layer map / loop schedule of a retrofit

            errs += validate_retrofit(self.train, mcfg)
        if (
            self.train is not None
            and self.schedule is not None
            and self.train.max_steps >= 1
            and not self.schedule.validate()
        ):
            from .schedule import build_lr_lambda  # warmup / decay lengths against max_steps, before any setup

            try:
                build_lr_lambda(self.schedule, self.train.max_steps)
            except ValueError as e:
                errs.append(
                    f"schedule: {e} (train.max_steps={self.train.max_steps}; schedule.warmup_steps / "
                    "warmup_fraction / decay_fraction)"
                )
        if (
            self.train is not None
            and self.train.num_grad_loops is not None
            and self.train.num_grad_loops > mcfg.n_loops
        ):
            errs.append(f"train.num_grad_loops: {self.train.num_grad_loops} exceeds the model's n_loops={mcfg.n_loops}")
        return errs

    def model_config(self):
        """The resolved ``ModelConfig`` (preset / YAML + ``model_overrides``)."""
        from ..config import load_model_config

        return load_model_config(self.model, dict(self.model_overrides) or None)

    def to_dict(self) -> dict:
        return to_dict(self)


def load_train_config(source: str | Path | dict, overrides: list[str] | None = None) -> TrainConfig:
    """Read a training YAML (or a dict), apply ``key=value`` overrides, validate everything.

    A relative ``model:`` path is resolved against the YAML file's directory when it exists there.
    Raises one ``ConfigError`` that lists every unknown key (with suggestions) and every bad value;
    an empty or comment-only file is refused (it would silently train the defaults).
    """
    base_dir = None
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"training config {str(path)!r} does not exist")
        data = read_yaml_file(path, "training config")  # refuses an empty / comment-only file
        base_dir = path.parent
    if overrides:
        data = apply_overrides(data, list(overrides))
    model = data.get("model")
    if base_dir is not None and isinstance(model, str) and model.endswith((".yaml", ".yml")):
        candidate = base_dir / model
        if not Path(model).exists() and candidate.exists():
            data["model"] = str(candidate)
    return from_dict(TrainConfig, data, what="training config")
