"""The training loop.

One optimizer update (``step`` counts completed updates; update ``t`` is 0-based)::

    lr      = peak · λ(t)                                 (schedule.py)
    seed    = torch.manual_seed(f(seed, t))                (exact resume of anything random)
    batch   = stream.next_batch(global_batch_size)         (same global batch on every rank)
    rows    = this rank's share, split into micro-batches of micro_batch_size
    for each micro-batch:                                   (DDP: no gradient sync until the last)
        with autocast(bf16):  loss = model(x, labels=x, num_loops=r, num_grad_loops=m).loss
        (loss / n_micro).backward()                         (gradient accumulation, paper §3)
    grad_norm = clip_grad_norm_(params, 1.0)               (global L2 norm, after the all-reduce;
                                                            grad_norm.py: the scaling folded into
                                                            a fused AdamW's step)
    non-finite loss or grad norm -> stop before the update (nan_policy: stop) or skip it (skip;
                                    max_consecutive_skips skipped updates in a row stop the run)
    optimizer.step(); optimizer.zero_grad()

Master weights stay fp32; ``precision: bf16`` autocasts the forward on CPU and CUDA (never fp16).
Backpropagation runs through all loops (full BPTT, the paper's default) unless
``activation_checkpointing`` (recompute each loop iteration), ``num_grad_loops`` (truncated BPTT)
or ``random_loops`` (random loop count per step, optionally truncated) is set.

Resuming: ``Trainer.fit`` loads the newest complete checkpoint of ``OUT/ckpt`` (model, optimizer,
data-stream position, step, token count) and continues; ``metrics.jsonl`` is cut back to that step
and appended to. On CPU in fp32 a resumed run reproduces an uninterrupted one bit for bit. A
tokenizer whose fingerprint differs from the checkpoint's is refused.

One trainer per output directory: ``fit`` holds :class:`~looplm.train.run_lock.RunDirLock` on
``OUT`` (rank 0) from before it touches the directory until it returns or dies.

Preemption: the first SIGTERM or SIGINT (how SLURM and Kubernetes preempt; Ctrl-C) lets the current
optimizer step finish, then every rank writes the checkpoint of that step and ``fit`` raises
:class:`TrainingInterrupted` (``looplm train`` prints one line naming the checkpoint and exits with
128 + the signal number). Ranks agree on the step with one 1-element all-reduce per step. A second
signal (after :data:`DUPLICATE_SIGNAL_S`: launchers such as torchrun forward the one they got) ends
the process at once. Resuming from that checkpoint is exact like any other resume.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..utils import cpu_malloc, cpuinfo
from ..data.tokenizers import check_tokenizer_fingerprint, tokenizer_fingerprint
from ..dataclass_util import to_dict
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .distributed import (
    DistInfo,
    all_reduce_max,
    all_reduce_mean,
    broadcast_object,
    cleanup,
    init_distributed,
    wrap_model,
)
from .grad_norm import clip_factor
from .grad_norm import total_norm as total_grad_norm
from .metrics import MetricsLogger, truncate_metrics, write_run_json
from .optim import MultiOptimizer, build_optimizer, freeze_parameters, plan_param_groups
from .run_lock import RunDirLock, RunDirLockedError
from .schedule import apply_lr, build_lr_lambda

__all__ = ["Trainer", "TrainingDivergedError", "TrainingInterrupted", "train", "step_seed", "batch_hash"]


def _load_init_weights(model: nn.Module, path: str) -> str:
    """``train.init_from``: load a checkpoint's model weights into ``model`` (before any resume).
    Parameters the checkpoint lacks are allowed only under ``rule.`` (a rule added for continued
    training, e.g. the exit gate on a fixed-loop model) and keep their initialisation."""
    from ..checkpoint_io import CheckpointError, load_tensors, resolve_checkpoint, verify_or_warn, with_tied_head

    ckpt = resolve_checkpoint(path)
    verify_or_warn(ckpt)
    sd = with_tied_head(model, load_tensors(ckpt / "model.safetensors"))  # an imported tied head is stored once
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not k.startswith("rule.")]
    if bad or unexpected:
        raise CheckpointError(
            f"train.init_from {str(ckpt)!r} does not fit this model: missing {bad[:5]}, unexpected {list(unexpected)[:5]} "
            "(only new recurrence-rule parameters may be missing)"
        )
    return f"initialised from {ckpt}" + (f" (new parameters keep their init: {missing})" if missing else "")


def _flat(d, prefix: str = "") -> dict:
    """``{"attention": {"n_heads": 2}}`` -> ``{"attention.n_heads": 2}`` (lists stay values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def model_config_changes(old: dict, new: dict) -> dict[str, tuple]:
    """The model-config fields that differ between a checkpoint's ``config.json`` ``model`` and this run's,
    as ``{field: (old, new)}``. A field only one side has (written by another looplm version) is no change."""
    import json

    a = _flat(json.loads(json.dumps(old, default=str)))
    b = _flat(json.loads(json.dumps(new, default=str)))  # tuples -> lists, as the checkpoint has them
    return {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]}


def _describe_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_resumed_state(state, path: str | os.PathLike, max_steps: int, lr_lambda, peak_lr: float) -> None:
    """Refuse a ``trainer_state.json`` whose values no run writes (hand-edited, or a bug elsewhere) before
    training on it: a negative step, a step beyond ``train.max_steps`` or other than the checkpoint's own,
    negative counters, or a step where the schedule's learning rate falls outside its range [0, peak]."""
    from .checkpoint import CheckpointError, STATE_FILE

    f = str(Path(path) / STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint file {f!r} is corrupted: it holds a {type(state).__name__}, not a JSON object"
        )
    for key in ("step", "data"):
        if key not in state:
            raise CheckpointError(f"checkpoint file {f!r} is corrupted: it has no {key!r} entry")

    def count(key, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"checkpoint file {f!r} has {key}={value!r}: must be a whole number >= 0 (a run never "
                "writes that; restore the file or resume from an earlier checkpoint)"
            )
        return value

    step = count("step", state["step"])
    for key in ("tokens", "consecutive_skips"):
        if key in state:
            count(key, state[key])
    el = state.get("elapsed_s", 0.0)
    if isinstance(el, bool) or not isinstance(el, (int, float)) or not math.isfinite(el) or el < 0:
        raise CheckpointError(f"checkpoint file {f!r} has elapsed_s={el!r}: must be a finite number >= 0")
    name = Path(path).name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != step:
        raise CheckpointError(
            f"checkpoint file {f!r} has step={step}, but the checkpoint is {name}: the file does "
            "not belong to it (restore it or resume from another checkpoint)"
        )
    if step > max_steps:
        raise CheckpointError(
            f"checkpoint file {f!r} has step={step}, beyond train.max_steps={max_steps}: nothing is left to train; "
            "raise --max-steps (train.max_steps) past it, or start over with --no-resume"
        )
    recorded = (state.get("schedule") or {}).get("multiplier_next") if isinstance(state.get("schedule"), dict) else None
    for what, m in (("the schedule at that step", lr_lambda(step)), ("schedule.multiplier_next", recorded)):
        if m is None:
            continue
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or not 0 <= m <= 1:
            lr = f"{m * peak_lr:.3g}" if isinstance(m, (int, float)) and not isinstance(m, bool) else "not a number"
            raise CheckpointError(
                f"checkpoint file {f!r} (step={step}): {what} gives the multiplier {m!r}, a learning rate of {lr}, "
                f"outside the schedule's range [0, {peak_lr:g}]; restore the file or resume from an earlier checkpoint"
            )


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN / Inf (raised before the optimizer update), or too
    many updates in a row were skipped for it (``nan_policy: skip``)."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM / SIGINT stopped training after a complete optimizer step, whose checkpoint was written
    (``checkpoint``: its directory on rank 0, ``None`` on the other ranks)."""

    def __init__(self, signum: int, step: int, max_steps: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {step} of {max_steps}: wrote checkpoint {checkpoint}; "
            "run the same command again to resume from it"
        )

    @property
    def exit_code(self) -> int:
        """``128 + signal number``, the shell's code for a process ended by that signal (143 for SIGTERM)."""
        return 128 + self.signum


# a repeat of the stop signal this soon after the first is the same request delivered twice (torchrun
# forwards the SIGINT / SIGTERM it gets to workers that got it too; SLURM signals every process)
DUPLICATE_SIGNAL_S = 0.5


class _StopOnSignal:
    """While active (main thread only): the first SIGTERM / SIGINT sets :attr:`signum` (the loop stops
    after the current optimizer step); a later one ends the process at once, by that signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool):
        self.signum = 0
        self.announce = announce
        self._first_at = 0.0
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            if self.announce:
                os.write(
                    2,
                    f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                    "(send it again to stop at once, without one)\n".encode(),
                )
        elif now - self._first_at > DUPLICATE_SIGNAL_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the default action: the process ends now


def step_seed(seed: int, step: int, purpose: str = "step") -> int:
    """A 63-bit seed derived from ``(seed, step, purpose)``: the same on every rank and on resume."""
    digest = hashlib.sha256(f"{seed}:{step}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def batch_hash(batch: torch.Tensor) -> str:
    """A short fingerprint of a token batch (logged per step to audit the data order)."""
    return hashlib.sha1(batch.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX). Without it, torch's
    bf16 GEMM falls back to a slow path (measured ~7x slower than fp32 on an AVX2-only EPYC)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpuinfo.flags())


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA devices that support it and on CPUs with native bf16, else ``fp32``."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


# compiling the blocks costs tens of seconds once; below this many steps it does not pay back
COMPILE_AUTO_MIN_STEPS = 200


def resolve_compile(setting, device: torch.device, precision: str, max_steps: int) -> bool:
    """``train.compile``: ``true`` / ``false``, or ``auto`` = compile where it pays: on CUDA, and on a CPU
    training in bf16 with native bf16 matmuls (where fusing the casts and elementwise ops of the
    autocast step measured faster, see benchmarks/bench_train.py), for runs of at least
    ``COMPILE_AUTO_MIN_STEPS`` steps (short runs would spend more time compiling than they save)."""
    if setting != "auto":
        return bool(setting)
    if max_steps < COMPILE_AUTO_MIN_STEPS:
        return False
    return device.type == "cuda" or (precision == "bf16" and cpu_has_fast_bf16())


def resolve_cpu_gemm(setting, device: torch.device, precision: str, fsdp: bool) -> bool:
    """``train.cpu_gemm``: ``true`` / ``false``, or ``auto`` = switch the ``nn.Linear`` layers to
    :class:`looplm.kernels.gemm.TunedLinear` when training in bf16 on a CPU with native bf16 (a
    SmolLM2-135M-shape step measured 8-9% faster, benchmarks/bench_train.py), not under FSDP2."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cpu" and precision == "bf16" and cpu_has_fast_bf16() and not fsdp


@dataclass
class _Geometry:
    global_batch: int
    per_rank: int
    micro: int
    n_micro: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


class Trainer:
    """Trains ``cfg`` into ``out_dir`` (resuming from ``out_dir/ckpt`` when a checkpoint is there).

    >>> Trainer(load_train_config("configs/train/tiny.yaml"), "runs/demo").fit()

    ``lock``: a :class:`RunDirLock` of ``out_dir`` the caller already holds (it stays held after
    ``fit``); by default ``fit`` takes the lock itself and releases it when it returns.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        out_dir: str | os.PathLike,
        *,
        resume: bool = True,
        quiet: bool = False,
        lock: RunDirLock | None = None,
    ):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.resume = resume
        self.quiet = quiet
        self.ckpt_root = self.out / "ckpt"
        self.lock = lock if lock is not None else RunDirLock(self.out)
        self._owns_lock = lock is None

    # ------------------------------------------------------------------------------ setup
    def _log(self, msg: str) -> None:
        if self.info.is_main and not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def _setup(self) -> None:
        from ..data.pipeline import build_stream
        from ..data.tokenizers import check_vocab, load_tokenizer
        from ..factory import build

        cfg, tc = self.cfg, self.cfg.train
        self.info: DistInfo = init_distributed(tc.device)
        info = self.info
        if tc.cpu_threads is not None and info.device.type == "cpu":
            torch.set_num_threads(tc.cpu_threads)
        self.malloc_kept = False
        if cpu_malloc.resolve(tc.cpu_malloc, info.device.type):
            # every step frees and reallocates the same large tensors: reuse their pages instead of
            # page-faulting fresh ones (measured 15-25% of a SmolLM2-shape CPU step, see looplm.utils.cpu_malloc)
            self.malloc_kept = cpu_malloc.keep_freed_memory()
            if not self.malloc_kept:
                self._log("warning: train.cpu_malloc=true needs glibc (Linux); the system allocator is left as it is")
        self.precision = resolve_precision(tc.precision, info.device)
        if self.precision == "bf16" and info.device.type == "cpu" and not cpu_has_fast_bf16():
            self._log(
                "warning: this CPU has no native bf16 matrix multiply (no AVX512-BF16 / AMX): bf16 autocast is "
                "several times slower than fp32 here; consider train.precision=fp32 (or auto)"
            )
        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        try:
            import numpy as np

            np.random.seed(tc.seed % (2**32))
        except ImportError:  # pragma: no cover
            pass

        # batch geometry
        G, mb, W = tc.global_batch_size, tc.micro_batch_size, info.world_size
        if G % W:
            raise ValueError(
                f"train.global_batch_size={G} is not divisible by the {W} processes; make it a multiple of {W}"
            )
        per_rank = G // W
        if per_rank % mb:
            raise ValueError(
                f"each of the {W} processes gets {per_rank} sequences per step, not a multiple of "
                f"train.micro_batch_size={mb}; pick micro_batch_size dividing {per_rank}"
            )
        self.geo = _Geometry(G, per_rank, mb, per_rank // mb, cfg.data.seq_len)

        # tokenizer, model, optimizer
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.model_cfg = cfg.model_config()
        check_vocab(self.tokenizer, self.model_cfg.vocab_size)
        model = build(self.model_cfg).to(info.device)
        if tc.init_from:  # continued training (e.g. exit-gate stages): start from these weights
            if tc.init_map is not None:  # retrofit: pretrained layers -> prelude / core / coda (looplm.hf.retrofit)
                from ..hf.retrofit import apply_layer_map

                self._log(apply_layer_map(model, tc.init_from, tc.init_map))
            else:
                self._log(_load_init_weights(model, tc.init_from))
        self.frozen = freeze_parameters(model, tc.freeze) if tc.freeze else []
        self.model = model  # unwrapped (FSDP2 shards it in place)
        self.plan = plan_param_groups(model, use_muon=cfg.optim.name == "muon_adamw")
        if tc.activation_checkpointing:
            from ..parallel import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        self.tuned_linears = 0
        if info.device.type == "cpu":
            from .. import kernels

            kernels.load("cpu")  # looplm's CPU training ops behind the model's dispatch points (built once if needed)
        if resolve_cpu_gemm(tc.cpu_gemm, info.device, self.precision, info.distributed and tc.parallel == "fsdp"):
            from ..kernels.gemm import tuned_linears

            self.tuned_linears = tuned_linears(model)  # before compiling: the blocks trace the tuned products
        self.compiled = resolve_compile(tc.compile, info.device, self.precision, tc.max_steps)
        self._compile_logged = False
        if self.compiled:
            from ..parallel import compile_blocks

            compile_blocks(model)  # one graph per block shape: the looped core compiles once, not K times
        truncated = tc.random_loops is not None or tc.num_grad_loops is not None
        self.wrapped: nn.Module = wrap_model(
            model, tc.parallel, info, tc.fsdp_granularity, find_unused_parameters=truncated
        )
        self.is_ddp = isinstance(self.wrapped, torch.nn.parallel.DistributedDataParallel)
        self.is_fsdp = info.distributed and tc.parallel == "fsdp"
        self.optimizer: MultiOptimizer = build_optimizer(model, cfg.optim, self.plan)
        self.lr_lambda = build_lr_lambda(cfg.schedule, tc.max_steps)

        # data
        self.stream = build_stream(cfg.data, self.tokenizer, split="train")
        self.has_val = cfg.data.holdout()[0] != "none"
        if not self.has_val and (cfg.eval.every or cfg.eval.at_end):
            self._log(
                "note: the data config has no validation split (data.val_every_nth: 0, no val_paths): evaluation is off"
            )
        if self.has_val and cfg.data.holdout()[0] == "paths" and (cfg.eval.every or cfg.eval.at_end):
            build_stream(cfg.data, self.tokenizer, split="val")  # missing val_paths: now, not after the last step

        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self.consecutive_skips = 0  # updates skipped in a row (nan_policy: skip)

    def _lock_run_dir(self) -> None:
        """Take the run directory's lock on rank 0; every rank fails if another trainer holds it."""
        error = None
        if self.info.is_main:
            try:
                self.lock.acquire()
            except RunDirLockedError as e:
                error = str(e)
        error = broadcast_object(error)
        if error is not None:
            raise RunDirLockedError(error)

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.info.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _step_autocast(self):
        """One autocast region around every micro-batch of a step. Autocast keeps the bf16 copy of each
        fp32 weight it casts until its outermost region exits, so with gradient accumulation the
        weights are cast once per step instead of once per micro-batch (and a looped core's weights
        once, not at every iteration); the values are the same, so the losses are bit-identical.
        (Compiled blocks cast their weights inside their own graph, at each call.) Not under FSDP2:
        there the cache would pin every unsharded bf16 weight for the whole step."""
        if self.is_fsdp:
            return contextlib.nullcontext()
        return self._autocast()

    def _no_autocast(self):
        """The backward pass runs outside autocast (as it would after a per-micro-batch region)."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.info.device.type, enabled=False)
        return contextlib.nullcontext()

    def _config_record(self) -> dict:
        return {
            "train": to_dict(self.cfg),
            "model": to_dict(self.model_cfg),
            "tokenizer": self.tokenizer.name,
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
        }

    # ------------------------------------------------------------------------------ resume
    def _maybe_resume(self) -> None:
        latest = None
        if self.resume and self.info.is_main:
            latest = latest_checkpoint(self.ckpt_root)
        latest = broadcast_object(str(latest) if latest is not None else None)
        metrics_path = self.out / "metrics.jsonl"
        if latest is None:
            if self.info.is_main and metrics_path.exists():
                dropped = truncate_metrics(metrics_path, 0)  # a fresh start: no stale lines
                if dropped:
                    self._log(
                        f"note: no checkpoint in {self.ckpt_root}; starting from scratch and clearing {metrics_path}"
                    )
            return
        self._check_model_unchanged(latest)
        state = load_checkpoint(latest, self.wrapped, list(self.optimizer), verify=self.cfg.checkpoint.verify)
        check_resumed_state(state, latest, self.cfg.train.max_steps, self.lr_lambda, self.cfg.optim.lr)
        note = check_tokenizer_fingerprint(
            self.tokenizer,
            state.get("tokenizer_fingerprint"),
            f"checkpoint {latest!r}",
            fix=f"start a new run with this tokenizer (--no-resume, or another --out than {str(self.out)!r})",
        )
        if note:
            self._log(f"warning: {note}")
        try:
            self.stream.load_state_dict(state["data"])
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # (ValueErrors say what differs themselves)
            from .checkpoint import STATE_FILE, CheckpointError

            raise CheckpointError(
                f"checkpoint file {str(Path(latest) / STATE_FILE)!r}: its 'data' entry is not a data-stream state this "
                f"run can read ({type(e).__name__}: {e}); restore the file or resume from an earlier checkpoint"
            ) from e
        self.step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.elapsed = float(state.get("elapsed_s", 0.0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        if state.get("global_batch_size") not in (None, self.geo.global_batch):
            self._log(
                f"warning: the checkpoint was trained with global_batch_size={state['global_batch_size']}, "
                f"now {self.geo.global_batch}; the data order continues but the run differs from the original"
            )
        if self.info.is_main:
            truncate_metrics(metrics_path, self.step)
        self._log(
            f"resumed from {latest} (step {self.step}, {self.tokens:,} tokens, saved on {state.get('world_size', '?')} process(es))"
        )

    def _check_model_unchanged(self, latest: str) -> None:
        """A resume with another model config than the checkpoint's (``model_overrides.n_loops=5`` on a
        K = 4 run) would go on training a different model, silently where the weights still fit: refused,
        naming every changed field, unless ``train.allow_model_change`` (``--allow-model-change``); then it
        is said on stderr and recorded in ``run.json`` (``model_changed_on_resume``)."""
        from .checkpoint import CONFIG_FILE, CheckpointError, load_json

        changes, error = {}, None
        if self.info.is_main:
            try:
                old = load_json(Path(latest) / CONFIG_FILE).get("model")
                if isinstance(old, dict):
                    changes = model_config_changes(old, to_dict(self.model_cfg))
            except (CheckpointError, AttributeError) as e:
                error = (
                    str(e)
                    if isinstance(e, CheckpointError)
                    else f"checkpoint file {str(Path(latest) / CONFIG_FILE)!r} is corrupted: not a JSON object"
                )
        changes, error = broadcast_object((changes, error))
        if error is not None:
            raise CheckpointError(error)
        self.model_changes = {}
        if not changes:
            return
        if not self.cfg.train.allow_model_change:
            raise CheckpointError(
                f"checkpoint {latest!r} was trained with another model config: {_describe_changes(changes)}; resuming "
                "would silently train a different model. Restore the checkpoint's values (model / model_overrides), "
                f"start a new run (--no-resume, or another --out than {str(self.out)!r}), or pass --allow-model-change "
                "(train.allow_model_change=true) to resume with the change, recorded in run.json"
            )
        self.model_changes = {"checkpoint": latest, "changes": {k: list(v) for k, v in changes.items()}}
        self._log(
            f"warning: resuming {latest} with a changed model config (train.allow_model_change): "
            f"{_describe_changes(changes)}; recorded in {self.out / 'run.json'}"
        )

    # ------------------------------------------------------------------------------ one step
    def _loop_counts(self, step: int) -> tuple[int | None, int | None]:
        tc = self.cfg.train
        if tc.loop_schedule is not None:  # retrofit: the loop count rises with the step (looplm.hf.retrofit)
            from ..hf.retrofit import loops_at

            r = loops_at(tc.loop_schedule, step)
            return r, None if tc.num_grad_loops is None else min(tc.num_grad_loops, r)
        rl = tc.random_loops
        if rl is None:
            return None, tc.num_grad_loops
        g = torch.Generator().manual_seed(step_seed(tc.seed, step, "loops"))
        n = self.geo.global_batch if rl.per_sequence else 1
        if rl.distribution == "poisson":
            r = torch.poisson(torch.full((n,), float(rl.mean)), generator=g).long().clamp(rl.min, rl.max)
        else:
            r = torch.randint(rl.min, rl.max + 1, (n,), generator=g)
        if rl.per_sequence:  # [global_batch]: sharded and split like the batch rows in _train_step
            return r, rl.grad_loops
        r = int(r[0])
        m = None if rl.grad_loops is None else min(rl.grad_loops, r)
        return r, m

    def _sync_context(self, last_micro: bool):
        if self.is_ddp and not last_micro:
            return self.wrapped.no_sync()
        if self.is_fsdp:
            self.wrapped.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def _train_step(self, step: int) -> dict:
        """Run update ``step`` (0-based). Returns the metrics record (``step`` is 1-based)."""
        tc, geo, info = self.cfg.train, self.geo, self.info
        t0 = time.perf_counter()
        multiplier = self.lr_lambda(step)
        apply_lr(self.optimizer, multiplier)
        torch.manual_seed(step_seed(tc.seed, step))
        num_loops, grad_loops = self._loop_counts(step)

        from ..data.pipeline import shard_batch

        batch = self.stream.next_batch(geo.global_batch)
        fingerprint = batch_hash(batch)
        local = shard_batch(batch, info.rank, info.world_size).to(info.device, non_blocking=True)
        self.wrapped.train()
        loss_sum = torch.zeros((), device=info.device, dtype=torch.float32)
        aux_sum = None
        row_loops = None  # per-sequence depths of this rank's rows, split like the rows
        if isinstance(num_loops, torch.Tensor):
            row_loops = shard_batch(num_loops[:, None], info.rank, info.world_size)[:, 0].split(geo.micro)
        with self._step_autocast():  # bf16 weight copies made once per step, not once per micro-batch
            for i, x in enumerate(local.split(geo.micro)):
                last = i == geo.n_micro - 1
                if row_loops is not None:
                    num_loops = row_loops[i].to(info.device)
                with self._sync_context(last):
                    with self._autocast():  # the chunked loss: no [B, T, V] logits (LoopedLM.forward return_logits)
                        out = self.wrapped(
                            x, labels=x, num_loops=num_loops, num_grad_loops=grad_loops, return_logits=False
                        )
                    loss = out.loss.float()
                    if out.aux_loss is not None:  # the rule's own term (already inside out.loss), logged on its own
                        aux = out.aux_loss.detach().float()
                        aux_sum = aux if aux_sum is None else aux_sum + aux
                    if tc.debug_nan_at_step is not None and 0 <= step + 1 - tc.debug_nan_at_step < tc.debug_nan_steps:
                        loss = loss * float("nan")  # testing aid: simulate diverged steps
                    with self._no_autocast():
                        (loss / geo.n_micro).backward()
                loss_sum += loss.detach()
        loss_value = float(all_reduce_mean(loss_sum / geo.n_micro))
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        # clip_grad_norm_ in parts (looplm.train.grad_norm): the norm is read back anyway (logged, NaN
        # policy), so the gradients are scaled only when torch's factor min(max_norm / (norm + 1e-6), 1)
        # can be below 1 (otherwise skipping changes no bit), and then inside the optimizer's step
        # where it is a fused AdamW (MultiOptimizer.step), not in a pass of its own.
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = total_grad_norm([p.grad for p in params])
        grad_norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # FSDP2: a DTensor
        grad_factor = None
        if self.is_fsdp:  # DTensor gradients: torch's own scaling pass
            if clip_factor(grad_norm, total, max_norm) is not None:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        else:
            grad_factor = clip_factor(grad_norm, total, max_norm)
        self.tokens += geo.tokens_per_step

        record = {
            "step": step + 1,
            "loss": loss_value,
            "lr": multiplier * self.cfg.optim.lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens,
        }
        if "muon" in self.optimizer.optimizers:
            record["muon_lr"] = multiplier * self.cfg.optim.muon_lr
        if aux_sum is not None:
            record["aux_loss"] = float(all_reduce_mean(aux_sum / geo.n_micro))
        rule_metrics = getattr(self.model.rule, "train_metrics", None)  # e.g. the exit gate's entropy / expected step
        if callable(rule_metrics):
            record.update(rule_metrics())
        if row_loops is not None:
            record["num_loops_mean"] = float(torch.cat(row_loops).float().mean())
        elif num_loops is not None:
            record["num_loops"] = num_loops
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what = f"loss is {loss_value}" if not math.isfinite(loss_value) else f"gradient norm is {grad_norm}"
            if tc.nan_policy == "stop":
                raise TrainingDivergedError(
                    f"step {step + 1}: the {what} (loss {loss_value}, grad norm {grad_norm}); stopped before the "
                    f"optimizer update, the model is unchanged since step {step}. Lower the learning rate, check the "
                    "data, resume from the last checkpoint, or set train.nan_policy=skip to skip such steps."
                )
            self.consecutive_skips += 1
            if self.consecutive_skips >= tc.max_consecutive_skips:
                first = step + 2 - self.consecutive_skips
                raise TrainingDivergedError(
                    f"step {step + 1}: the {what}, and the {self.consecutive_skips} updates of steps {first}-{step + 1} "
                    f"were all skipped (train.nan_policy=skip, train.max_consecutive_skips={tc.max_consecutive_skips}): "
                    f"training has diverged; stopped, the model is unchanged since step {first - 1}. Lower the learning "
                    "rate, check the data, or resume from an earlier checkpoint."
                )
            record["skipped"] = True
            self._log(
                f"warning: step {step + 1}: the {what}; skipped this update (train.nan_policy=skip, "
                f"{self.consecutive_skips} in a row of at most {tc.max_consecutive_skips})"
            )
        else:
            self.consecutive_skips = 0
            self.optimizer.step(grad_factor=grad_factor)
            self.optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if self.compiled and not self._compile_logged:
            self._compile_logged = True
            record["compile_step_s"] = dt  # the first step after (re)start includes compiling the blocks
            self._log(f"compile: the first step took {dt:.1f} s including block compilation")
        record.update(
            tokens_per_s=geo.tokens_per_step / dt if dt > 0 else None,
            step_time_s=dt,
            batch_hash=fingerprint,
        )
        return record

    def _first_compiled_step(self, step: int) -> dict:
        """The first step with compiled blocks, where they are compiled. With ``train.compile: auto`` a
        compilation failure (a corrupt inductor cache entry: "invalid ELF header", no C++ compiler, ...)
        falls back to eager blocks with one warning and the step runs again from the same state; with
        ``compile: true`` the error stands, with a note on what to do."""
        stream_state = copy.deepcopy(self.stream.state_dict())
        tokens = self.tokens
        try:
            return self._train_step(step)
        except TrainingDivergedError:
            raise
        except Exception as e:
            if self.cfg.train.compile != "auto":
                e.add_note(
                    "looplm: train.compile=true and compiling the blocks failed at the first step. A corrupt inductor "
                    "cache entry (e.g. 'invalid ELF header') goes away with the cache (TORCHINDUCTOR_CACHE_DIR, by "
                    "default /tmp/torchinductor_$USER); train.compile=auto would train eagerly instead, false never compiles."
                )
                raise
            from ..parallel import uncompile_blocks

            inner = getattr(e, "inner_exception", None) or e  # dynamo's BackendCompilerFailed wraps the cause
            first = (str(inner).strip().splitlines() or [""])[0][:300]
            self._log(
                f"warning: train.compile=auto: compiling the blocks failed at the first step ({type(inner).__name__}: "
                f"{first}); training with eager blocks instead. Clearing the inductor cache (TORCHINDUCTOR_CACHE_DIR, "
                "by default /tmp/torchinductor_$USER) usually lets compiling work again"
            )
            uncompile_blocks(self.model)
            torch._dynamo.reset()
            self.compiled = False
            self.optimizer.zero_grad(set_to_none=True)
            self.stream.load_state_dict(stream_state)  # the same batch again
            self.tokens = tokens
            return self._train_step(step)

    # ------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean next-token loss over ``eval.batches`` validation batches (the same each time)."""
        from ..data.pipeline import iter_val_batches, shard_batch

        info, geo = self.info, self.geo
        self.wrapped.eval()
        nll = torch.zeros((), dtype=torch.float64, device=info.device)
        count = torch.zeros((), dtype=torch.float64, device=info.device)
        rows = self.cfg.eval.batch_size or geo.micro * info.world_size
        for batch in iter_val_batches(self.cfg.data, self.tokenizer, self.cfg.eval.batches, rows):
            usable = batch.shape[0] - batch.shape[0] % info.world_size  # every rank needs the same row count
            if usable == 0:
                continue
            local = shard_batch(batch[:usable], info.rank, info.world_size).to(info.device)
            for x in local.split(geo.micro):
                with self._autocast():
                    out = self.wrapped(x, labels=x, return_logits=False)
                n = x.shape[0] * (x.shape[1] - 1)
                nll += out.lm_loss.double() * n  # the next-token loss alone, whatever the rule adds
                count += n
        self.wrapped.train()
        if info.distributed:
            import torch.distributed as dist

            dist.all_reduce(nll)
            dist.all_reduce(count)
        if float(count) == 0:
            self._log("warning: the validation split yielded no full batch; no val_loss this time")
            return {}
        val_loss = float(nll / count)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}

    # ------------------------------------------------------------------------------ checkpoint
    def save(self) -> Path | None:
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed,
            "data": self.stream.state_dict(),
            "world_size": self.info.world_size,
            "global_batch_size": self.geo.global_batch,
            "schedule": {"name": self.cfg.schedule.name, "multiplier_next": self.lr_lambda(self.step)},
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
            "consecutive_skips": self.consecutive_skips,
        }
        path = save_checkpoint(
            self.ckpt_root,
            self.step,
            self.wrapped,
            list(self.optimizer),
            state,
            self._config_record(),
            keep_last=self.cfg.checkpoint.keep_last,
        )
        self.saved_step = self.step
        return path

    # ------------------------------------------------------------------------------ main loop
    def fit(self) -> dict:
        """Train until ``train.max_steps``; return a summary dict (on every rank)."""
        try:
            return self._fit()
        finally:
            if self._owns_lock:
                self.lock.release()
            cleanup()

    def _fit(self) -> dict:
        self._setup()
        self._lock_run_dir()  # before anything in the directory is read or written
        cfg, tc, info = self.cfg, self.cfg.train, self.info
        if info.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        self._maybe_resume()
        start_step = self.step
        n_params = sum(p.numel() for p in self.model.parameters())  # local shard sizes under FSDP
        if info.is_main:
            write_run_json(
                self.out,
                to_dict(cfg),
                {
                    "model_config": to_dict(self.model_cfg),
                    "num_params": self.model.num_params() if not self.is_fsdp else None,
                    "world_size": info.world_size,
                    "device": str(info.device),
                    "precision": self.precision,
                    "compiled": self.compiled,
                    "cpu_malloc_kept": self.malloc_kept,
                    "tuned_linears": self.tuned_linears,
                    "resumed_from_step": start_step or None,
                    "param_groups": self.plan.summary(),
                    "frozen_params": len(self.frozen),
                    **({"model_changed_on_resume": self.model_changes} if getattr(self, "model_changes", None) else {}),
                },
            )
        logger = MetricsLogger(
            self.out,
            enabled=info.is_main,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            wandb_run_name=cfg.logging.wandb_run_name,
            config=to_dict(cfg),
        )
        self._log(
            f"training {self.model_cfg.name} ({n_params:,} params) on {info.world_size} x {info.device}, "
            f"{self.precision}, global batch {self.geo.global_batch} x {self.geo.seq_len} tokens "
            f"({self.geo.n_micro} micro-batch(es) of {self.geo.micro} per process), steps {start_step}->{tc.max_steps}"
        )
        bar = None
        if info.is_main and cfg.logging.progress_bar and not self.quiet:
            from tqdm import tqdm

            bar = tqdm(
                total=tc.max_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.1 if sys.stderr.isatty() else 5.0,
            )  # redirected logs: fewer lines
        first_loss = last_loss = None
        last_eval: dict = {}
        last_ckpt = None
        self.saved_step = None
        stop = _StopOnSignal(announce=info.is_main and not self.quiet)
        try:
            stop.install()  # SIGTERM / SIGINT: finish this step, write its checkpoint, raise TrainingInterrupted
            while self.step < tc.max_steps:
                if self.compiled and not self._compile_logged:
                    record = self._first_compiled_step(self.step)
                else:
                    record = self._train_step(self.step)
                self.step += 1
                self.elapsed += record["step_time_s"]
                record["elapsed_s"] = self.elapsed
                if not record.get("skipped"):
                    first_loss = record["loss"] if first_loss is None else first_loss
                    last_loss = record["loss"]
                done = self.step >= tc.max_steps
                do_eval = self.has_val and (
                    (cfg.eval.every and self.step % cfg.eval.every == 0) or (done and cfg.eval.at_end)
                )
                if do_eval:
                    last_eval = self.evaluate()
                    record.update(last_eval)
                logger.log(record)
                if bar is not None:
                    bar.update(1)
                    post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
                    if "val_loss" in record:
                        post["val"] = f"{record['val_loss']:.4f}"
                    bar.set_postfix(post)
                elif info.is_main and not self.quiet and (self.step % cfg.logging.log_every == 0 or done or do_eval):
                    extra = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                    self._log(
                        f"step {self.step}/{tc.max_steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                        f"grad_norm {record['grad_norm']:.3f} {record['tokens_per_s'] or 0:,.0f} tok/s{extra}"
                    )
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or (done and cfg.checkpoint.at_end):
                    last_ckpt = self.save()
                # every rank stops at the same step: one 1-element all-reduce per step under torchrun
                signum = all_reduce_max(stop.signum, info.device) if info.distributed else stop.signum
                if signum and not done:
                    if self.saved_step != self.step:
                        last_ckpt = self.save()  # collective: every rank takes part
                    raise TrainingInterrupted(signum, self.step, tc.max_steps, last_ckpt)
                if tc.debug_step_sleep_s > 0:
                    time.sleep(tc.debug_step_sleep_s)
        finally:
            stop.restore()
            if bar is not None:
                bar.close()
            logger.close()
        return {
            "out_dir": str(self.out),
            "start_step": start_step,
            "steps": self.step,
            "tokens": self.tokens,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "val_loss": last_eval.get("val_loss"),
            "val_ppl": last_eval.get("val_ppl"),
            "train_time_s": self.elapsed,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "world_size": info.world_size,
            "precision": self.precision,
        }


def train(cfg: TrainConfig, out_dir: str | os.PathLike, **kw) -> dict:
    """Convenience: ``Trainer(cfg, out_dir, **kw).fit()``."""
    return Trainer(cfg, out_dir, **kw).fit()
