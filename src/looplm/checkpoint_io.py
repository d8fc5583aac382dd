"""Reading the checkpoints ``looplm train`` writes: locate, verify, load weights, rebuild for inference.

Everything here works without ``torch.distributed`` and without the training code, so
``looplm generate`` and ``looplm eval`` load checkpoints without importing :mod:`looplm.train`
(which writes checkpoints and resumes from them, see :mod:`looplm.train.checkpoint` for the layout).

* :func:`resolve_checkpoint` accepts a checkpoint directory, a ``ckpt/`` directory or a run
  directory (its newest *complete* checkpoint);
* :func:`verify_checkpoint` checks every file's size and SHA-256 against the ``COMPLETE`` manifest
  and raises :class:`CheckpointError` naming the missing / truncated / corrupted file;
* :func:`load_model_for_inference` rebuilds the model from ``config.json``, loads the safetensors
  weights (never a pickle) and loads the tokenizer the run recorded, refusing one whose
  fingerprint changed since training (a tokenizer replaced at the same path).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dataclass_util import ConfigError, split_override

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "INFERENCE_OVERRIDES",
    "checkpoint_path",
    "looplm_contents",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "verify_checkpoint",
    "verify_or_warn",
    "load_model_weights",
    "assign_state_dict",
    "with_tied_head",
    "read_checkpoint_config",
    "load_model_for_inference",
    "nonfinite_tensors",
    "refuse_nonfinite",
    "ALLOW_DEEP_ENV",
    "ALLOW_NONFINITE_ENV",
    "MAX_LOOPS",
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

# model-config fields that may differ from training when decoding: neither changes a weight's
# shape nor what the weights compute (n_loops is the default loop count, like --loops)
INFERENCE_OVERRIDES = ("max_seq_len", "n_loops")

ALLOW_NONFINITE_ENV = "LOOPLM_ALLOW_NONFINITE"  # =1: load weights holding NaN / inf (studying broken checkpoints)
ALLOW_DEEP_ENV = "LOOPLM_ALLOW_DEEP"  # =1: load a model config with more than MAX_LOOPS loops
# a model's own loop count (its trained K) past this is refused at import and load unless asked for (allow_deep):
# the config is its own reference, so the bound is absolute. Ouro trains K = 4, Huginn r = 32 (run to 64 or so)
MAX_LOOPS = 4096


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupted (the message names the file)."""


class CheckpointWarning(UserWarning):
    """A checkpoint can be used, but something could not be checked or differs from training."""


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


def looplm_contents(path: str | os.PathLike) -> str | None:
    """What looplm data the directory ``path`` holds, that writing over it would destroy: ``"run"`` (a
    training run: ``ckpt/``, ``metrics.jsonl``, ``run.json`` or its lock), ``"training checkpoint"``
    (one step of a run: ``trainer_state.json``), ``"checkpoint"`` (weights + config, e.g. from ``looplm
    import hf``) or ``None`` (nothing of looplm's; a Hugging Face directory such as an export)."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / "ckpt").is_dir() or any((p / f).exists() for f in ("metrics.jsonl", "run.json", "train.lock")):
        return "run"
    if (p / STATE_FILE).is_file() or (STEP_RE.match(p.name) and (p / MODEL_FILE).is_file()):
        return "training checkpoint"
    if (p / MARKER).is_file():
        return "checkpoint"
    if (p / CONFIG_FILE).is_file() and (p / MODEL_FILE).is_file():
        try:
            cfg = json.loads((p / CONFIG_FILE).read_text())
        except (OSError, ValueError):
            cfg = None
        if isinstance(cfg, dict) and "model" in cfg and "model_type" not in cfg:  # looplm's record, not HF's
            return "checkpoint"
    return None


# ----------------------------------------------------------------------------------- reading files
def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file as CPU tensors (``CheckpointError`` naming it if missing or unreadable)."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is truncated or corrupted and cannot be read ({e})"
        ) from e


def load_json(path: Path) -> Any:
    """A JSON file of a checkpoint (``CheckpointError`` naming it if missing or not valid JSON)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is truncated or corrupted: not valid JSON ({e})") from e
    except RecursionError as e:  # json's parser recurses per nesting level
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is corrupted: it nests its arrays / objects too deeply to be read"
        ) from e


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
    manifest = load_json(marker)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint file {str(marker)!r} is corrupted: it lists no files")
    bad = [
        n
        for n, info in files.items()
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str))
    ]
    if bad:
        raise CheckpointError(
            f"checkpoint file {str(marker)!r} is corrupted: the entries of {bad[:5]} lack their bytes / sha256"
        )
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing (listed in {MARKER})")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {str(f)!r} is truncated or corrupted: {size} bytes, expected {info['bytes']}"
            )
        if check_hashes and sha256_of(f) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file {str(f)!r} is corrupted: its SHA-256 does not match the one in {MARKER}"
            )
    return manifest


def verify_or_warn(ckpt: Path, check_hashes: bool = True) -> dict | None:
    """:func:`verify_checkpoint` when ``ckpt`` has its ``COMPLETE`` manifest; without one (a checkpoint
    written by hand, or one whose writing was interrupted) a :class:`CheckpointWarning` says that it is
    loaded unverified. Returns the manifest or ``None``."""
    if (ckpt / MARKER).is_file():
        return verify_checkpoint(ckpt, check_hashes=check_hashes)
    warnings.warn(
        f"checkpoint {str(ckpt)!r} has no {MARKER} manifest, so its files cannot be verified (it may have been "
        "interrupted while being written); loading it unverified. Prefer a complete checkpoint",
        CheckpointWarning,
        stacklevel=3,
    )
    return None


# ----------------------------------------------------------------------------------- loading
def load_model_weights(path: str | os.PathLike, model: nn.Module, verify: bool = True) -> Path:
    """Load only the model weights of a checkpoint (or a run directory's newest one) into an
    unwrapped ``model``, without any collective; returns the checkpoint directory used. A checkpoint
    without its ``COMPLETE`` manifest loads with a :class:`CheckpointWarning` (:func:`verify_or_warn`).

    A model built by :func:`looplm.factory.build_for_loading` (parameters on the ``meta`` device) takes the
    file's tensors as its parameters (``assign``: no initialisation, no copy), cast to the dtypes it was
    built with; a tied head is tied again. A checkpoint of a tied model may store the head once (as the
    embedding), as ``looplm import hf`` writes it."""
    ckpt = resolve_checkpoint(path)
    verify_or_warn(ckpt, check_hashes=verify)
    sd = with_tied_head(model, load_tensors(ckpt / MODEL_FILE))
    try:
        if any(p.is_meta for p in model.parameters()):
            assign_state_dict(model, sd)
        else:
            model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"the weights in {str(ckpt / MODEL_FILE)!r} do not fit this model: {e}") from e
    return ckpt


def with_tied_head(model: nn.Module, sd: dict) -> dict:
    """``sd`` with ``lm_head.weight`` filled in from ``embed.weight`` when ``model`` ties them and the file
    stores the shared tensor once."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "tie_embeddings", False) and "lm_head.weight" not in sd and "embed.weight" in sd:
        sd = {**sd, "lm_head.weight": sd["embed.weight"]}
    return sd


def assign_state_dict(model: nn.Module, sd: dict) -> None:
    """Load ``sd`` into a ``model`` built on the meta device: its tensors become the parameters (cast to the
    dtype each was built with), a tied head is tied again, and nothing may stay on ``meta`` (a computed
    buffer without real values would be garbage; the error names it)."""
    own = model.state_dict(keep_vars=True)
    sd = {k: v.to(own[k].dtype) if k in own and v.dtype != own[k].dtype else v for k, v in sd.items()}
    attrs = {n: dict(p.__dict__) for n, p in model.named_parameters()}  # e.g. _no_muon marks
    model.load_state_dict(sd, strict=True, assign=True)
    if getattr(model.config, "tie_embeddings", False):
        model.lm_head.weight = model.embed.weight
    for n, p in model.named_parameters():
        p.__dict__.update({k: v for k, v in attrs.get(n, {}).items() if k not in p.__dict__})
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensor(s) have no values after loading: {left[:5]}")


def nonfinite_tensors(tensors) -> list[str]:
    """The names of the floating-point tensors of ``tensors`` (a state dict, or ``(name, tensor)`` pairs) that
    hold a NaN or an infinity (one ``isfinite(...).all()`` per tensor: cheap beside reading them)."""
    import torch

    items = tensors.items() if isinstance(tensors, dict) else tensors
    return [n for n, t in items if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all())]


def refuse_nonfinite(tensors, where: str, *, allow: bool | None = None, flag: str = "--allow-nonfinite") -> None:
    """Raise :class:`CheckpointError` naming the tensors of ``tensors`` that hold NaN / inf (the first few and
    how many): such weights decode to garbage. ``allow=True`` (or ``LOOPLM_ALLOW_NONFINITE=1`` when ``allow`` is
    ``None``) skips the check, for studying broken checkpoints."""
    if allow is None:
        allow = os.environ.get(ALLOW_NONFINITE_ENV, "") not in ("", "0")
    if allow:
        return
    bad = nonfinite_tensors(tensors)
    if bad:
        shown = ", ".join(bad[:5]) + (f", ... ({len(bad) - 5} more)" if len(bad) > 5 else "")
        raise CheckpointError(
            f"{where} holds NaN or infinite values in {len(bad)} tensor(s) ({shown}): a model with them produces "
            f"garbage. To load it anyway (to study it), pass {flag} (allow_nonfinite=True, or set {ALLOW_NONFINITE_ENV}=1)"
        )


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a checkpoint (``{"train": {...}, "model": {...}, "tokenizer": ...}``)."""
    ckpt = resolve_checkpoint(path)
    return load_json(ckpt / CONFIG_FILE)


def _inference_overrides(overrides: list[str] | dict | None) -> dict:
    """``--set`` items for a trained model: only :data:`INFERENCE_OVERRIDES`, all problems in one error."""
    if not overrides:
        return {}
    items = dict(overrides) if isinstance(overrides, dict) else dict(split_override(o) for o in overrides)
    bad = [k for k in items if k not in INFERENCE_OVERRIDES]
    if bad:
        allowed = ", ".join(INFERENCE_OVERRIDES)
        raise ConfigError(
            [
                f"{k}: cannot be changed on a trained checkpoint (it changes the weights' shapes or what they compute); "
                f"only {allowed} can be set"
                for k in bad
            ],
            "overrides for a checkpoint",
        )
    return items


def refuse_deep(
    n_loops: int, where: str, *, allow: bool | None = None, field: str = "n_loops", flag: str = "--allow-deep"
) -> None:
    """Refuse a model config of more than :data:`MAX_LOOPS` loops unless ``allow`` (``None``: the
    ``LOOPLM_ALLOW_DEEP`` environment variable decides), naming ``where`` and the count."""
    if allow is None:
        allow = os.environ.get(ALLOW_DEEP_ENV, "") not in ("", "0")
    if n_loops > MAX_LOOPS and not allow:
        raise CheckpointError(
            f"{where}: {field} = {n_loops:,} loops, more than {MAX_LOOPS:,} (every token would run the core "
            f"{n_loops:,} times: decoding would not finish). If it is meant, pass {flag} (allow_deep=True, or set "
            f"{ALLOW_DEEP_ENV}=1)"
        )


def load_model_for_inference(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    verify: bool = True,
    *,
    tokenizer=None,
    overrides: list[str] | dict | None = None,
    allow_nonfinite: bool | None = None,
    allow_deep: bool | None = None,
):
    """``(model, tokenizer)`` from a checkpoint or a run directory (newest complete checkpoint).

    The model is rebuilt from the checkpoint's ``config.json`` (resolved model config), loaded with
    the safetensors weights, moved to ``device`` and put in eval mode.

    Args:
        tokenizer: ``None`` = the tokenizer the run recorded; its fingerprint must match the
            recorded one (a :class:`~looplm.data.tokenizers.TokenizerMismatchError` otherwise).
            A tokenizer or spec given here replaces it, with a :class:`CheckpointWarning` when its
            fingerprint differs from the recorded one.
        overrides: ``["max_seq_len=4096", ...]`` or a dict: only :data:`INFERENCE_OVERRIDES` are
            accepted (anything else would not fit or would misuse the trained weights).
        allow_nonfinite: load weights holding NaN / inf (refused by default, naming them; ``None`` = the
            ``LOOPLM_ALLOW_NONFINITE`` environment variable decides).
        allow_deep: load a config whose loop count ``n_loops`` is past :data:`MAX_LOOPS` (refused by default:
            every token would run the core that many times and decoding would not finish; ``None`` = the
            ``LOOPLM_ALLOW_DEEP`` environment variable decides).
    """
    from .config import load_model_config
    from .data.tokenizers import check_tokenizer_fingerprint, check_vocab, load_tokenizer, tokenizer_fingerprint
    from .factory import build_for_loading

    ckpt = resolve_checkpoint(path)
    cfg = load_json(ckpt / CONFIG_FILE)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), (dict, str)):
        raise CheckpointError(
            f"checkpoint file {str(ckpt / CONFIG_FILE)!r} has no model config; cannot rebuild the model"
        )
    # parameters on the meta device, then the file's tensors become them: no random init, no copy
    mcfg = load_model_config(cfg["model"], _inference_overrides(overrides) or None)
    refuse_deep(mcfg.n_loops, f"checkpoint file {str(ckpt / CONFIG_FILE)!r}", allow=allow_deep)
    model = build_for_loading(mcfg)
    load_model_weights(ckpt, model, verify=verify)
    refuse_nonfinite(model.state_dict(), f"checkpoint file {str(ckpt / MODEL_FILE)!r}", allow=allow_nonfinite)

    recorded_spec = cfg.get("tokenizer") or cfg.get("train", {}).get("data", {}).get("tokenizer", "byte")
    recorded = cfg.get("tokenizer_fingerprint")
    what = f"checkpoint {str(ckpt)!r}"
    if tokenizer is None:
        tok = load_tokenizer(recorded_spec)
        note = check_tokenizer_fingerprint(
            tok, recorded, what, fix="pass the tokenizer it was trained with explicitly (looplm generate --tokenizer)"
        )
        if note:
            warnings.warn(note, CheckpointWarning, stacklevel=2)
    else:
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        current = tokenizer_fingerprint(tok)
        if recorded is not None and current is not None and current != recorded:
            warnings.warn(
                f"the tokenizer {tok.name!r} (fingerprint {current}) is not the one {what} was trained with "
                f"({recorded_spec!r}, fingerprint {recorded}): its token ids mean other text to this model",
                CheckpointWarning,
                stacklevel=2,
            )
    check_vocab(tok, model.config.vocab_size)
    return model.to(device).eval(), tok
