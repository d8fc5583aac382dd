"""``looplm import hf``: a Hugging Face checkpoint directory as a looplm checkpoint.

Sources:

* a looplm export (``config.json`` with ``model_type: looplm``): the looplm config and weights are
  read back directly — no transformers model is built — so ``export → import`` is exact (same config,
  same tensors, same tokenizer ids);
* a transformers Llama / Qwen3 / Mamba-2 causal LM (safetensors or a GGUF file through transformers'
  GGUF loader, which needs the ``gguf`` package): loaded with ``AutoModelForCausalLM`` in fp32 and
  converted by :func:`looplm.interop.from_transformers` (``(p, s, K, c) = (0, L, 1, 0)``, the same logits).
* an Ouro (``model_type: ouro``) or Huginn / Raven (``model_type: huginn_raven``) checkpoint: its own
  format read by :mod:`looplm.hf.public` — no remote code runs — into looplm's driver (sandwich / post-sum
  norms, the exit gate or the adapter and random state as rule options), every tensor checked first; a
  Nanbeige4.2 checkpoint (``model_type: nanbeige``) the same way (:mod:`looplm.hf.nanbeige`).

The result is a checkpoint directory like one ``looplm train`` writes (``model.safetensors``,
``config.json`` with ``{"model": ..., "tokenizer": ..., "tokenizer_fingerprint": ...}`` and a
``COMPLETE`` manifest with sizes and SHA-256), with the tokenizer saved in ``OUT/tokenizer/``
(recorded by absolute path) and the model config alone in ``OUT/model.yaml`` (for ``model:`` in a
training config that retrofits it, see :mod:`looplm.hf.retrofit`). ``looplm generate --checkpoint OUT``, ``looplm eval ... OUT`` and
``train.init_from: OUT`` accept it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from .export import PREFIX
from .weights import (
    INDEX_FILE,
    MAX_IMPORT_LOOPS,
    _read_json,
    preflight,
    read_shapes,
    refuse_mismatch,
    refuse_overlap,
    weight_files,
)

__all__ = [
    "MAX_IMPORT_LOOPS",
    "import_hf",
    "preflight",
    "write_checkpoint",
    "read_export",
    "weight_files",
    "read_shapes",
]


def write_checkpoint(out: str | Path, model, tokenizer, *, extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (a ``LoopedLM``) and ``tokenizer`` as a complete looplm checkpoint directory."""
    from safetensors.torch import save_file

    from ..checkpoint_io import CONFIG_FILE, FORMAT_VERSION, MARKER, MODEL_FILE, sha256_of
    from ..data.tokenizers import tokenizer_fingerprint

    from ..checkpoint_io import looplm_contents

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) or another directory"
        )
    held = looplm_contents(out)
    if held in ("run", "training checkpoint"):  # overwriting an earlier import is what --overwrite is for
        raise FileExistsError(
            f"{str(out)!r} holds a looplm {'training run' if held == 'run' else held}; writing a checkpoint over "
            "it would break it (even with --overwrite): pick another directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    if getattr(tokenizer, "name", None) == "byte":
        tok_spec = "byte"
    else:
        tokenizer.save(out / "tokenizer")
        from .tokenizer import make_portable

        make_portable(out / "tokenizer")  # loadable by transformers 4.x too (not TokenizersBackend, no auto_map)
        tok_spec = str((out / "tokenizer").resolve())
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:  # the tied head is the embedding: stored once (checkpoint_io.with_tied_head)
        del sd["lm_head.weight"]
    save_file(sd, str(out / MODEL_FILE), metadata={"format": "pt", "step": "0"})
    record = {
        "model": model.config.to_dict(),
        "tokenizer": tok_spec,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        **(extra or {}),
    }
    (out / CONFIG_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    import yaml

    # the model config on its own, for `model: OUT/model.yaml` in a training config (retrofitting)
    (out / "model.yaml").write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    files = [MODEL_FILE, CONFIG_FILE]
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": 0,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {f: {"bytes": (out / f).stat().st_size, "sha256": sha256_of(out / f)} for f in files},
    }
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, out / MARKER)
    return out


def read_export(src: str | Path, *, allow_deep: bool = False, allow_large: bool = False):
    """``(model, tokenizer)`` from a looplm export directory, without transformers' model classes.

    The weights are read from exactly the files the format names (:func:`weight_files`) and must match
    the config's tensors one for one (names and shapes) before any is loaded; the config passes
    :func:`preflight` first."""
    from safetensors.torch import load_file

    from ..checkpoint_io import CheckpointError
    from ..data.tokenizers import HFTokenizer, load_tokenizer
    from ..checkpoint_io import assign_state_dict
    from ..config import ModelConfig
    from ..factory import build_for_loading

    src = Path(src)
    cfg = _read_json(src / "config.json", "config file")
    if not isinstance(cfg.get("looplm"), dict):
        raise ValueError(f"config file {str(src / 'config.json')!r} has no looplm model config (key 'looplm')")
    mcfg = ModelConfig.from_dict(cfg["looplm"])
    preflight(mcfg, where=f"looplm export {str(src)!r}", allow_deep=allow_deep, allow_large=allow_large)
    if cfg.get("looplm_tokenizer") != "byte":
        from .tokenizer import check_tokenizer_dir

        check_tokenizer_dir(src)
    model = build_for_loading(mcfg)  # on meta: the file's tensors become it
    files = weight_files(src)
    tied = model.config.tie_embeddings
    expected = {
        PREFIX + k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    shapes = read_shapes(files)
    if tied:
        shapes.pop(PREFIX + "lm_head.weight", None)  # an export stores a tied head once; an extra copy is harmless
    refuse_mismatch(
        src,
        [k for k in expected if k not in shapes],
        [k for k in shapes if k not in expected],
        [(k, shapes[k], expected[k]) for k in expected if k in shapes and shapes[k] != expected[k]],
        what=f"its looplm config ({model.config.name})",
    )
    sd = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # the header was fine, the data is not
            raise CheckpointError(f"weight file {str(f)!r} is truncated or corrupted and cannot be read ({e})") from e
    sd = {k.removeprefix(PREFIX): v for k, v in sd.items()}
    if tied:
        sd["lm_head.weight"] = sd["embed.weight"]
    assign_state_dict(model, sd)
    if cfg.get("looplm_tokenizer") == "byte":
        tok = load_tokenizer("byte")
    else:
        # the export's tokenizer is a plain PreTrainedTokenizerFast; load it by that class (AutoTokenizer
        # would read config.json, which names remote code the tokenizer does not need)
        from transformers import PreTrainedTokenizerFast

        try:
            backend = PreTrainedTokenizerFast.from_pretrained(str(src), trust_remote_code=False)
        except Exception as e:  # transformers' TypeError / ValueError about a field, naming no file
            raise ValueError(
                f"the tokenizer of looplm export {str(src)!r} could not be loaded ({_first_line(e)}): "
                "tokenizer_config.json or special_tokens_map.json holds a value of the wrong kind"
            ) from e
        tok = HFTokenizer(backend, str(src), kind="transformers")
    return model.eval(), tok


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:limit]}"


@contextlib.contextmanager
def _transformers_errors_only():
    """transformers prints a table of missing / unexpected weights; :func:`refuse_mismatch` says it in one line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _load_transformers(src: Path, gguf_file: str | None):
    """``(hf_model, hf_tokenizer)`` of a Llama / Qwen3 / Mamba-2 directory (or a GGUF file in it), fp32.

    Every tensor of the model must come from the source: transformers would fill a missing or
    mis-shaped one with random values; here that is refused, listing them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file:
        what = f"GGUF file {str(src / gguf_file)!r}"
        fix = "it is truncated, corrupted or of a GGUF version transformers cannot read"
    else:
        what = f"Hugging Face model directory {str(src)!r}"
        fix = "its config.json or weight files are corrupted or of an unsupported kind"
    try:
        with _transformers_errors_only():
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                str(src),
                dtype=torch.float32,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                trust_remote_code=False,
                **kw,
            )
    except Exception as e:  # transformers' and the file readers' own types; one line naming the source instead
        raise ValueError(f"{what} could not be loaded ({_first_line(e)}): {fix}") from e
    # mismatched_keys: (name, shape in the file, shape of the model) with ignore_mismatched_sizes
    mismatched = [(m[0], tuple(m[1]), tuple(m[2])) for m in info.get("mismatched_keys") or ()]
    refuse_mismatch(
        src / gguf_file if gguf_file else src,
        info.get("missing_keys") or (),
        info.get("unexpected_keys") or (),
        mismatched,
        what=f"its {hf_model.config.model_type} config",
    )
    if info.get("error_msgs"):
        raise ValueError(f"{what}: transformers reported errors while loading the weights: {info['error_msgs'][:3]}")
    try:
        hf_tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False, **kw)
    except Exception as e:
        raise ValueError(f"the tokenizer of {what} could not be loaded ({_first_line(e)})") from e
    return hf_model.eval(), hf_tok


def import_hf(
    src: str | Path,
    out: str | Path,
    *,
    gguf_file: str | None = None,
    overwrite: bool = False,
    dtype: str | torch.dtype | None = None,
    allow_nonfinite: bool = False,
    allow_deep: bool = False,
    allow_large: bool = False,
    **overrides,
) -> Path:
    """Convert a Hugging Face model directory (or ``src`` = a ``.gguf`` file) into a looplm checkpoint at ``out``.

    ``overrides`` change the imported config before the weights are copied (``n_loops=2`` loops the
    whole imported stack; shapes must stay the same). ``dtype`` (Ouro / Huginn): the weights' dtype in the
    looplm checkpoint (default float32, whatever the files hold). Refused before anything is written: an
    ``out`` that is ``src`` or inside it; weights holding NaN / inf (``allow_nonfinite`` lets them through);
    more than :data:`MAX_IMPORT_LOOPS` loops (``allow_deep``); parameters that cannot fit in this machine's
    available memory (``allow_large``). Returns ``out``.
    """
    from ..checkpoint_io import refuse_nonfinite
    from ..data.tokenizers import HFTokenizer
    from .tokenizer import check_tokenizer_dir

    src = Path(src)
    if src.is_file() and src.suffix == ".gguf":
        src, gguf_file = src.parent, src.name
    if not src.is_dir():
        raise FileNotFoundError(f"{str(src)!r} is not a Hugging Face model directory (or a .gguf file)")
    refuse_overlap(src, out, "import")
    if Path(out).exists() and any(Path(out).iterdir()) and not overwrite:  # before loading anything
        raise FileExistsError(
            f"{str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) or another directory"
        )
    loops = overrides.get("n_loops")
    if isinstance(loops, int) and not isinstance(loops, bool) and loops > MAX_IMPORT_LOOPS and not allow_deep:
        raise ValueError(
            f"n_loops = {loops:,} (--set) is more than {MAX_IMPORT_LOOPS:,} loops: decoding would not "
            "finish. If it is meant, pass allow_deep=True (--allow-deep)"
        )
    cfg_path = src / "config.json"
    from .weights import refuse_dangling

    refuse_dangling(cfg_path)  # else it would read as "no config.json"
    hf_cfg = _read_json(cfg_path, "config file") if cfg_path.is_file() else {}
    is_export = hf_cfg.get("model_type") == "looplm"
    if is_export:
        model, tok = read_export(src, allow_deep=allow_deep, allow_large=allow_large)
        if overrides:
            from ..factory import build

            new = build(model.config.replace(**overrides))
            new.load_state_dict(model.state_dict())
            model = new
        origin = {"imported_from": str(src.resolve()), "imported_kind": "looplm-export"}
    elif gguf_file is None and _public_family(hf_cfg) is not None:
        from .public import load_public

        model, tok, origin = load_public(
            src, dtype=_dtype(dtype), allow_deep=allow_deep, allow_large=allow_large, **overrides
        )
    else:
        if gguf_file is None and not cfg_path.is_file():
            ggufs = sorted(src.glob("*.gguf"))
            if len(ggufs) != 1:
                raise FileNotFoundError(
                    f"{str(src)!r} has no config.json" + (f" and {len(ggufs)} .gguf files: pass one" if ggufs else "")
                )
            gguf_file = ggufs[0].name
        if gguf_file is not None:
            gpath = src / gguf_file
            if not gpath.is_file():
                raise FileNotFoundError(f"GGUF file {str(gpath)!r} does not exist")
            with open(gpath, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ValueError(f"{str(gpath)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")
        else:
            _check_transformers_config(hf_cfg, cfg_path, allow_large=allow_large)
            for name in ("generation_config.json",):  # read by transformers: a clear error naming it instead
                if (src / name).is_file():
                    _read_json(src / name, "generation config")
            if any(src.glob("*.safetensors")) or (src / INDEX_FILE).exists():
                # exactly the files the format names, their headers intact, before transformers loads anything
                read_shapes(weight_files(src))
        check_tokenizer_dir(src)  # before transformers reads it (a GGUF directory may hold one too)
        from ..interop import from_transformers

        hf_model, hf_tok = _load_transformers(src, gguf_file)
        model = from_transformers(hf_model, **overrides).eval()
        tok = HFTokenizer(
            hf_tok, str(src), kind="transformers", eos_token=None if hf_tok.eos_token else _guess_eos(hf_tok)
        )
        origin = {
            "imported_from": str(src.resolve()) + (f"/{gguf_file}" if gguf_file else ""),
            "imported_kind": hf_model.config.model_type,
        }
    if dtype is not None:
        model = model.to(_dtype(dtype))
    # after the cast: an fp16 cast of large weights overflows to inf
    refuse_nonfinite(model.state_dict(), f"the weights of {str(src)!r}", allow=allow_nonfinite)
    from ..data.tokenizers import check_vocab

    try:  # the checkpoint would be written, then refused by every command that loads it
        check_vocab(tok, model.config.vocab_size)
    except ValueError as e:
        raise ValueError(f"{str(src)!r}: its tokenizer does not fit its model, nothing was written: {e}") from e
    return write_checkpoint(out, model, tok, extra={"import": origin}, overwrite=overwrite)


# integer fields of a transformers config.json that must be positive where present (Llama / Qwen3 / Mamba-2)
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "state_size",
    "expand",
    "num_heads",
    "n_groups",
    "conv_kernel",
    "chunk_size",
)


def _check_transformers_config(c: dict, path: Path, *, allow_large: bool = False) -> None:
    """The integer sizes of a transformers ``config.json`` (positive integers, every bad one named), then the
    memory its parameters need (fp32, the transformers model and its looplm copy) — before transformers builds it."""
    from ..dataclass_util import ConfigError
    from ..factory import check_fits

    errs = []
    for f in _POSITIVE_INTS:
        v = c.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            errs.append(f"{f}: must be a positive integer, got {v!r}")
    for f in ("torch_dtype", "dtype"):  # transformers reads it as getattr(torch, name): a bad one fails far off
        v = c.get(f)
        if (
            v is not None
            and v != "auto"
            and not (
                isinstance(v, str)
                and isinstance(getattr(torch, v, None), torch.dtype)
                and getattr(torch, v).is_floating_point
            )
        ):
            errs.append(f"{f}: must name a floating-point torch dtype (float32, bfloat16, float16) or auto, got {v!r}")
    if errs:
        raise ConfigError(errs, f"model config {str(path)!r}")
    d, V, L = c.get("hidden_size") or 0, c.get("vocab_size") or 0, c.get("num_hidden_layers") or 0
    H = c.get("num_attention_heads") or 1
    hd = c.get("head_dim") or d // H
    kv = c.get("num_key_value_heads") or H
    if c.get("model_type") == "mamba2":
        layer = 3 * (c.get("expand") or 2) * d * d
    else:
        layer = 2 * d * H * hd + 2 * d * kv * hd + 3 * d * (c.get("intermediate_size") or 0)
    n = V * d * (1 if c.get("tie_word_embeddings") else 2) + L * layer
    check_fits(
        2 * 4 * n,
        f"the model of {str(path)!r} (fp32, loaded by transformers then copied)",
        allow=allow_large,
        flag="--allow-large",
    )


def _public_family(hf_cfg: dict) -> str | None:
    from .public import detect

    return detect(hf_cfg)


def _dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return dt


def _guess_eos(hf_tok) -> str | None:
    from ..data.tokenizers import EOS_CANDIDATES

    vocab = hf_tok.get_vocab()
    return next((t for t in EOS_CANDIDATES if t in vocab), None)
