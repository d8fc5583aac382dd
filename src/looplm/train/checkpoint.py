"""Checkpoints: atomic, verifiable, pickle-free, and independent of the world size.

Layout (one directory per optimizer step)::

    OUT/ckpt/step_000123/
        model.safetensors        full (unsharded) fp32 model weights, keyed by parameter name
        optimizer.safetensors    optimizer tensors (momentum buffers, Adam moments, steps) by name
        optimizer.json           optimizer hyper-parameters per parameter name (lr, betas, ...)
        rng.safetensors          torch CPU (+ CUDA) RNG state of rank 0, as uint8 tensors
        trainer_state.json       step, tokens, data-stream state, python RNG, schedule position,
                                 tokenizer fingerprint
        config.json              resolved training and model configs (rebuild the model), the tokenizer's
                                 spec and fingerprint
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

A write that fails (a full disk, a quota, an I/O error) removes the partial ``.tmp-step_*`` directory and
raises :class:`CheckpointError` naming the file, the system's reason and the previous complete checkpoint,
which stays intact.

Loading verifies each file's size and SHA-256 against ``COMPLETE`` and raises
:class:`CheckpointError` naming the file that is missing, truncated or corrupted.

Locating, verifying and reading checkpoints (and loading one for inference) lives in
:mod:`looplm.checkpoint_io`, outside the training package; it is re-exported here.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint_io import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MARKER,
    MODEL_FILE,
    OPTIM_JSON,
    OPTIM_TENSORS,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_json,
    load_model_for_inference,
    load_model_weights,
    load_tensors,
    read_checkpoint_config,
    resolve_checkpoint,
    sha256_of,
    verify_checkpoint,
)
from ..data.stream import rng_state_from_json, rng_state_to_json
from .distributed import barrier, broadcast_object, get_rank, get_world_size, is_distributed

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


# ----------------------------------------------------------------------------------- helpers
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
        optim_sd = get_optimizer_state_dict(model, opts, options=_state_dict_options(cpu_offload=True))
    final = checkpoint_path(root, step)
    error = None
    if get_rank() == 0:
        try:
            _write_checkpoint(root, final, step, model_sd, optim_sd if opts else None, trainer_state, config)
        except CheckpointError as e:
            error = str(e)
        else:
            _prune(root, keep_last)
    barrier()
    error = broadcast_object(error)  # every rank stops on rank 0's failure, none waits for it
    if error is not None:
        raise CheckpointError(error)
    return final if get_rank() == 0 else None


def _write_checkpoint(
    root: Path,
    final: Path,
    step: int,
    model_sd: dict,
    optim_sd: dict | None,
    trainer_state: dict | None,
    config: dict | None,
) -> None:
    """Rank 0's part of :func:`save_checkpoint`. A write that fails (a full disk, a quota, an I/O error)
    removes what it had written of this checkpoint and raises :class:`CheckpointError` naming the file, the
    system's reason and the newest complete checkpoint, which it never touched."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    current = tmp
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        current = tmp / MODEL_FILE
        _save_tensors(model_sd, current, metadata={"format": "pt", "step": str(step)})
        files = [MODEL_FILE]
        if optim_sd is not None:
            tensors, other = _split_optim_state(optim_sd)
            current = tmp / OPTIM_TENSORS
            _save_tensors(tensors, current)
            current = tmp / OPTIM_JSON
            _write_json(current, other)
            files += [OPTIM_TENSORS, OPTIM_JSON]
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        current = tmp / RNG_FILE
        _save_tensors(rng, current)
        state = dict(trainer_state or {})
        state.setdefault("step", step)
        state["python_rng"] = rng_state_to_json(random.getstate())
        current = tmp / STATE_FILE
        _write_json(current, state)
        current = tmp / CONFIG_FILE
        _write_json(current, config or {})
        files += [RNG_FILE, STATE_FILE, CONFIG_FILE]
        for f in files:
            current = tmp / f
            _fsync_file(current)
        _fsync_dir(tmp)
        current = final
        if final.exists():  # an incomplete leftover of an interrupted save of this step
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": {f: {"bytes": (final / f).stat().st_size, "sha256": sha256_of(final / f)} for f in files},
        }
        current = final / (MARKER + ".tmp")
        _write_json(current, manifest)
        _fsync_file(current)
        os.replace(current, final / MARKER)
        _fsync_dir(final)
    except Exception as e:
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":  # safetensors' own, for a failed write
            raise
        for partial in (tmp, final):
            if partial == final and (final / MARKER).is_file():
                continue  # complete: the failure came after it was whole
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError) and e.errno:
            why = f"{os.strerror(e.errno)}, {errno.errorcode.get(e.errno, e.errno)}"
        else:
            why = str(e) or type(e).__name__
        prev = latest_checkpoint(root)
        kept = (
            f"the previous complete checkpoint {str(prev)!r} is intact"
            if prev is not None
            else f"there is no earlier complete checkpoint in {str(root)!r}"
        )
        raise CheckpointError(
            f"could not write checkpoint {final.name}: writing {str(current)!r} failed ({why}); removed its partial "
            f"files, {kept}. Free some space (or fix the error) and resume"
        ) from e


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and stale temporary dirs."""
    for p in root.glob(".tmp-step_*"):
        if p.is_dir() and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last > 0:
        for _, p in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------- load
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
    if get_rank() == 0:
        try:
            verify_checkpoint(path, check_hashes=verify)
            model_sd = load_tensors(path / MODEL_FILE)
            if opts:
                optim_sd = _merge_optim_state(load_tensors(path / OPTIM_TENSORS), load_json(path / OPTIM_JSON))
            state = load_json(path / STATE_FILE)
            rng = load_tensors(path / RNG_FILE) if (path / RNG_FILE).exists() else {}
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)

    distributed = is_distributed() and get_world_size() > 1
    try:
        set_model_state_dict(
            model, model_sd, options=_state_dict_options(broadcast_from_rank0=distributed, strict=True)
        )
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
            random.setstate(rng_state_from_json(state["python_rng"]))
    return state
