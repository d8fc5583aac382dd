"""Run logging: ``metrics.jsonl``, ``run.json``, TensorBoard and (optionally) Weights & Biases.

``OUT/metrics.jsonl`` has one JSON object per optimizer update (written by rank 0, flushed every
line, so a killed run keeps everything up to its last step)::

    {"step": 12, "loss": 3.91, "lr": 0.0029, "muon_lr": 0.0029, "grad_norm": 0.84,
     "tokens": 24576, "tokens_per_s": 40123.5, "step_time_s": 0.051, "elapsed_s": 0.9,
     "batch_hash": "3f2a...", "num_loops": 3}
    {"step": 100, ..., "val_loss": 2.71, "val_ppl": 15.03}

* ``step``: optimizer updates done (1-based; the checkpoint ``step_000100`` is taken after step 100).
* ``loss``: mean training loss over the global batch (before the update).
* ``lr`` / ``muon_lr``: the AdamW / Muon learning rate used by this update.
* ``grad_norm``: global L2 norm of the gradients before clipping.
* ``tokens``: tokens consumed so far (global); ``tokens_per_s``: this step's throughput.
* ``batch_hash``: a hash of the global batch (to check that a resumed run sees the same data).
* ``skipped``: present (true) when the update was skipped by ``nan_policy: skip``.
* ``val_loss`` / ``val_ppl``: on evaluation steps.

On resume, lines with ``step`` greater than the checkpoint's step are dropped first
(:func:`truncate_metrics`), so the file never holds a step twice.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "truncate_metrics", "MetricsLogger", "run_info", "write_run_json"]


def _clean(v: Any) -> Any:
    """JSON-safe value: non-finite floats become ``null`` (strict JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a ``metrics.jsonl`` (a torn last line from a killed run is ignored)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {str(path)!r}; is this a `looplm train` output directory?")
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):  # a line that is JSON but no record (an edit, another tool's file): skipped
            out.append(rec)
    return out


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop records with ``step > step`` (and torn lines) from ``path``; return how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step", 0), int):  # not a record this logger wrote
            dropped += 1
            continue
        if rec.get("step", 0) > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
    return dropped


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    for cwd in (here, Path.cwd()):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return None


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_info() -> dict:
    """Environment facts for ``run.json``: git SHA, package versions, host, command line."""
    import torch

    pkgs = ["looplm", "torch", "numpy", "safetensors", "tokenizers", "transformers", "datasets", "tensorboard"]
    return {
        "git_sha": _git_sha(),
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in pkgs},
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_json(out_dir: str | os.PathLike, config: dict, extra: dict | None = None) -> Path:
    """Write ``OUT/run.json``: the resolved config + :func:`run_info` + ``extra``.

    A resumed run keeps the previous descriptions under ``"previous"`` (newest last).
    """
    path = Path(out_dir) / "run.json"
    record = {"config": config, **run_info(), **(extra or {})}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            previous = old.pop("previous", [])
            record["previous"] = previous + [old]
        except json.JSONDecodeError:
            pass
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, path)
    return path


class MetricsLogger:
    """Appends records to ``metrics.jsonl`` and mirrors scalars to TensorBoard / W&B (rank 0 only)."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "looplm",
        wandb_run_name: str | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
            except ImportError:
                print(
                    "note: tensorboard is not installed; TensorBoard logging is off (pip install tensorboard)",
                    file=sys.stderr,
                )
        if wandb:
            try:
                import wandb as _wandb

                self._wandb = _wandb.init(project=wandb_project, name=wandb_run_name, config=config, resume="allow")
            except ImportError:
                print("note: wandb is not installed; W&B logging is off (pip install wandb)", file=sys.stderr)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        rec = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        step = int(rec["step"])
        scalars = {
            k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"train/{k}" if not k.startswith("val_") else f"val/{k[4:]}", v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
