"""Checkpoints: atomic, verifiable, pickle-free, and independent of the world size.

Layout (one directory per optimizer step)::

    OUT/ckpt/step_000123/
        model.safetensors        full (unsharded) fp32 model weights, keyed by parameter name
        optimizer.safetensors    optimizer tensors (momentum buffers, Adam moments, steps) by name
        optimizer.json           optimizer hyper-parameters per parameter name (lr, betas, ...)
        rng.safetensors          torch CPU (+ CUDA) RNG state of rank 0, as uint8 tensors
        trainer_state.json       step, tokens, data-stream state, python RNG, schedule position
        config.json              resolved training config and model config (rebuilds the model)
        COMPLETE                 written last: JSON with the size and SHA-256 of every file

Writing is atomic: rank 0 writes everything into ``ckpt/.tmp-step_000123-<pid>/``, fsyncs each
file, renames the directory to ``step_000123`` and only then writes ``COMPLETE`` (also fsynced).
A crash at any point leaves either no ``step_000123`` or one without ``COMPLETE``, which
:func:`latest_checkpoint` ignores (and the next save of that step replaces).

World-size independence uses ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True``): the
states are gathered into plain, name-keyed tensors (whatever the wrapping: none, DDP or FSDP2)
and, on load, re-sharded for the current world size (``set_*_state_dict``, rank 0 reads and
broadcasts). We store them with safetensors + JSON instead of DCP's default ``.distcp`` format,
whose ``.metadata`` file is a pickle: loading a checkpoint here never executes pickled code
(no ``torch.load`` at all). The cost is that the full state passes through rank 0's CPU memory,
which is fine up to a few billion parameters.

Loading verifies each file's size and SHA-256 against ``COMPLETE`` and raises
:class:`CheckpointError` naming the file that is missing, truncated or corrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed import barrier, broadcast_object

__all__ = [
    "CheckpointError",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_checkpoint_config",
    "load_model_for_inference",
    "verify_checkpoint",
]

MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
OPTIM_TENSORS = "optimizer.safetensors"
OPTIM_JSON = "optimizer.json"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
STEP_RE = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted (the message names the file)."""


# ----------------------------------------------------------------------------------- locating
def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """``root/step_000123``."""
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | os.PathLike, complete_only: bool = True) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (not complete_only or (p / MARKER).is_file()):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest *complete* checkpoint under ``root`` (``None`` if there is none)."""
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Accept a checkpoint directory, a ``ckpt/`` directory or a run directory; return a checkpoint.

    A run directory resolves to the newest complete checkpoint in ``RUN/ckpt``.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint or run directory {str(p)!r} does not exist")
    if (p / MODEL_FILE).exists() or STEP_RE.match(p.name):
        return p
    for root in (p / "ckpt", p):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise CheckpointError(
        f"{str(p)!r} holds no complete checkpoint (looked for step_*/{MARKER} in {p / 'ckpt'} and {p}); "
        "train with checkpointing on, or pass a checkpoint directory"
    )


# ----------------------------------------------------------------------------------- helpers
def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=True))


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    out, seen = {}, set()
    for k, t in tensors.items():
        t = t.detach().cpu()
        if t.data_ptr() in seen and t.numel() > 0:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        out[k] = t.contiguous()
    save_file(out, str(path), metadata=metadata)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is truncated or corrupted and cannot be read ({e})") from e


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is truncated or corrupted: not valid JSON ({e})") from e


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _state_dict_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _split_optim_state(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Name-keyed optimizer state ``{"state": {fqn: {k: v}}, "param_groups": [...]}`` ->
    (tensors for safetensors keyed ``"<fqn>/<k>"``, everything else for JSON)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in osd.get("state", {}).items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{fqn}/{k}"] = v
            else:
                scalars.setdefault(fqn, {})[k] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd.get("param_groups", [])]
    return tensors, {"param_groups": groups, "state_scalars": scalars}


def _merge_optim_state(tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        fqn, _, k = key.rpartition("/")
        state.setdefault(fqn, {})[k] = t
    for fqn, entry in other.get("state_scalars", {}).items():
        state.setdefault(fqn, {}).update(entry)
    groups = []
    for g in other.get("param_groups", []):
        # JSON lists were tuples (betas, ns_coefficients); "params" stays a list of names
        groups.append({k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()})
    return {"state": state, "param_groups": groups}


# ----------------------------------------------------------------------------------- save
def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer=None,
    trainer_state: dict | None = None,
    config: dict | None = None,
    keep_last: int = 0,
) -> Path | None:
    """Write ``root/step_XXXXXX`` atomically. Collective: every rank must call it.

    Args:
        root: the checkpoint root (``OUT/ckpt``).
        step: optimizer updates done so far.
        model: the (possibly DDP / FSDP2-wrapped) model.
        optimizer: a ``MultiOptimizer``, a list of optimizers or one optimizer (or ``None``).
        trainer_state: JSON-serialisable loop state (step, tokens, data-stream state, ...).
        config: JSON-serialisable configs (``{"train": ..., "model": ...}``).
        keep_last: keep only the newest ``keep_last`` complete checkpoints (0 = keep all).

    Returns the checkpoint directory on rank 0, ``None`` on other ranks.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    root = Path(root)
    opts = _optimizers(optimizer)
    # collectives first (FSDP all-gathers), every rank participates; rank 0 receives the full state
    model_sd = get_model_state_dict(model, options=_state_dict_options(cpu_offload=True))
    optim_sd = {}
    if opts:
        optim_sd = get_optimizer_state_dict(
            model, opts, options=_state_dict_options(cpu_offload=True)
        )
    final = checkpoint_path(root, step)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _save_tensors(model_sd, tmp / MODEL_FILE, metadata={"format": "pt", "step": str(step)})
        files = [MODEL_FILE]
        if opts:
            tensors, other = _split_optim_state(optim_sd)
            _save_tensors(tensors, tmp / OPTIM_TENSORS)
            _write_json(tmp / OPTIM_JSON, other)
            files += [OPTIM_TENSORS, OPTIM_JSON]
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        _save_tensors(rng, tmp / RNG_FILE)
        state = dict(trainer_state or {})
        state.setdefault("step", step)
        state["python_rng"] = _python_rng_to_json(random.getstate())
        _write_json(tmp / STATE_FILE, state)
        _write_json(tmp / CONFIG_FILE, config or {})
        files += [RNG_FILE, STATE_FILE, CONFIG_FILE]
        for f in files:
            _fsync_file(tmp / f)
        _fsync_dir(tmp)
        if final.exists():  # an incomplete leftover of an interrupted save of this step
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": {f: {"bytes": (final / f).stat().st_size, "sha256": _sha256(final / f)} for f in files},
        }
        marker_tmp = final / (MARKER + ".tmp")
        _write_json(marker_tmp, manifest)
        _fsync_file(marker_tmp)
        os.replace(marker_tmp, final / MARKER)
        _fsync_dir(final)
        _prune(root, keep_last)
    barrier()
    return final if _rank() == 0 else None


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and stale temporary dirs."""
    for p in root.glob(".tmp-step_*"):
        if p.is_dir() and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last > 0:
        for _, p in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)


def _python_rng_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng_from_json(obj) -> tuple:
    version, internal, gauss = obj
    return (version, tuple(internal), gauss)


# ----------------------------------------------------------------------------------- load
def verify_checkpoint(path: str | os.PathLike, check_hashes: bool = True) -> dict:
    """Check the ``COMPLETE`` manifest against the files; return the manifest.

    Raises ``CheckpointError`` naming the first missing / truncated / corrupted file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: it has no {MARKER} marker (it was interrupted while being "
            "written). Delete it or pass an earlier checkpoint; `looplm train` skips it automatically."
        )
    manifest = _load_json(marker)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint file {str(marker)!r} is corrupted: it lists no files")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing (listed in {MARKER})")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {str(f)!r} is truncated or corrupted: {size} bytes, expected {info['bytes']}"
            )
        if check_hashes and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {str(f)!r} is corrupted: its SHA-256 does not match the one in {MARKER}")
    return manifest


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer=None,
    verify: bool = True,
    restore_rng: bool = True,
) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``); return the trainer state dict.

    Collective: every rank must call it. Rank 0 reads and verifies the files, the states are
    broadcast and re-sharded for the current world size (which may differ from the saving one).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    opts = _optimizers(optimizer)
    error = None
    model_sd: dict = {}
    optim_sd: dict = {}
    state: dict = {}
    rng: dict = {}
    if _rank() == 0:
        try:
            verify_checkpoint(path, check_hashes=verify)
            model_sd = _load_tensors(path / MODEL_FILE)
            if opts:
                optim_sd = _merge_optim_state(_load_tensors(path / OPTIM_TENSORS), _load_json(path / OPTIM_JSON))
            state = _load_json(path / STATE_FILE)
            rng = _load_tensors(path / RNG_FILE) if (path / RNG_FILE).exists() else {}
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)

    distributed = _is_dist() and dist.get_world_size() > 1
    try:
        set_model_state_dict(model, model_sd, options=_state_dict_options(broadcast_from_rank0=distributed, strict=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"the weights in {str(path / MODEL_FILE)!r} do not fit this model ({e}); check that the model config "
            "(preset and model_overrides) matches the one the checkpoint was trained with"
        ) from e
    if opts:
        try:
            set_optimizer_state_dict(
                model,
                opts,
                optim_sd,
                options=_state_dict_options(broadcast_from_rank0=distributed),
            )
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"the optimizer state in {str(path / OPTIM_TENSORS)!r} does not fit this optimizer ({e}); "
                "the optimizer settings (optim.name) must match the ones the checkpoint was trained with"
            ) from e
    state = broadcast_object(state)
    if restore_rng:
        if rng.get("torch_cpu") is not None:
            torch.set_rng_state(rng["torch_cpu"])
        if rng.get("torch_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
        if "python_rng" in state:
            random.setstate(_python_rng_from_json(state["python_rng"]))
    return state


def load_model_weights(path: str | os.PathLike, model: nn.Module, verify: bool = True) -> Path:
    """Load only the model weights of a checkpoint (or a run directory's newest one) into an
    unwrapped ``model``, without any collective; returns the checkpoint directory used."""
    ckpt = resolve_checkpoint(path)
    if (ckpt / MARKER).exists():
        verify_checkpoint(ckpt, check_hashes=verify)
    sd = _load_tensors(ckpt / MODEL_FILE)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"the weights in {str(ckpt / MODEL_FILE)!r} do not fit this model: {e}") from e
    return ckpt


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a checkpoint (``{"train": {...}, "model": {...}}``)."""
    ckpt = resolve_checkpoint(path)
    return _load_json(ckpt / CONFIG_FILE)


def load_model_for_inference(path: str | os.PathLike, device: str | torch.device = "cpu", verify: bool = True):
    """``(model, tokenizer)`` from a checkpoint or a run directory (newest complete checkpoint).

    The model is rebuilt from the checkpoint's ``config.json`` (resolved model config), loaded
    with the safetensors weights, moved to ``device`` and put in eval mode.
    """
    from ..config import ModelConfig
    from ..data.tokenizers import load_tokenizer
    from ..model import build

    ckpt = resolve_checkpoint(path)
    cfg = _load_json(ckpt / CONFIG_FILE)
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise CheckpointError(f"checkpoint file {str(ckpt / CONFIG_FILE)!r} has no model config; cannot rebuild the model")
    model = build(ModelConfig.from_dict(cfg["model"]))
    load_model_weights(ckpt, model, verify=verify)
    tok_spec = cfg.get("tokenizer") or cfg.get("train", {}).get("data", {}).get("tokenizer", "byte")
    tokenizer = load_tokenizer(tok_spec)
    return model.to(device).eval(), tokenizer
