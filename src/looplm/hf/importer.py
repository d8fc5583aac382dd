"""``looplm import hf``: a Hugging Face checkpoint directory as a looplm checkpoint.

Sources:

* a looplm export (``config.json`` with ``model_type: looplm``): the looplm config and weights are
  read back directly — no transformers model is built — so ``export → import`` is exact (same config,
  same tensors, same tokenizer ids);
* a transformers Llama / Qwen3 / Mamba-2 causal LM (safetensors or a GGUF file through transformers'
  GGUF loader, which needs the ``gguf`` package): loaded with ``AutoModelForCausalLM`` in fp32 and
  converted by :func:`looplm.interop.from_transformers` (``(p, s, K, c) = (0, L, 1, 0)``, the same logits).

The result is a checkpoint directory like one ``looplm train`` writes (``model.safetensors``,
``config.json`` with ``{"model": ..., "tokenizer": ..., "tokenizer_fingerprint": ...}`` and a
``COMPLETE`` manifest with sizes and SHA-256), with the tokenizer saved in ``OUT/tokenizer/``
(recorded by absolute path) and the model config alone in ``OUT/model.yaml`` (for ``model:`` in a
training config that retrofits it, see :mod:`looplm.hf.retrofit`). ``looplm generate --checkpoint OUT``, ``looplm eval ... OUT`` and
``train.init_from: OUT`` accept it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .export import PREFIX

__all__ = ["import_hf", "write_checkpoint", "read_export"]


def write_checkpoint(out: str | Path, model, tokenizer, *, extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` (a ``LoopedLM``) and ``tokenizer`` as a complete looplm checkpoint directory."""
    from safetensors.torch import save_file

    from ..checkpoint_io import CONFIG_FILE, FORMAT_VERSION, MARKER, MODEL_FILE, sha256_of
    from ..data.tokenizers import tokenizer_fingerprint

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) or another directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    if getattr(tokenizer, "name", None) == "byte":
        tok_spec = "byte"
    else:
        tokenizer.save(out / "tokenizer")
        tok_spec = str((out / "tokenizer").resolve())
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:  # safetensors refuses shared storage: store the tied head as its own copy
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(out / MODEL_FILE), metadata={"format": "pt", "step": "0"})
    record = {"model": model.config.to_dict(), "tokenizer": tok_spec,
              "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), **(extra or {})}
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


def read_export(src: str | Path):
    """``(model, tokenizer)`` from a looplm export directory, without transformers' model classes."""
    from safetensors.torch import load_file

    from ..data.tokenizers import HFTokenizer, load_tokenizer
    from .remote.modeling_looplm import build_looplm_model

    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    model = build_looplm_model(cfg["looplm"])
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(src)!r} has no *.safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    sd = {k.removeprefix(PREFIX): v for k, v in sd.items()}
    if model.config.tie_embeddings:
        sd.setdefault("lm_head.weight", sd["embed.weight"])
    model.load_state_dict(sd, strict=True)
    if cfg.get("looplm_tokenizer") == "byte":
        tok = load_tokenizer("byte")
    else:
        # the export's tokenizer is a plain PreTrainedTokenizerFast; load it by that class (AutoTokenizer
        # would read config.json, which names remote code the tokenizer does not need)
        from transformers import PreTrainedTokenizerFast

        backend = PreTrainedTokenizerFast.from_pretrained(str(src))
        tok = HFTokenizer(backend, str(src), kind="transformers")
    return model.eval(), tok


def _load_transformers(src: Path, gguf_file: str | None):
    """``(hf_model, hf_tokenizer)`` of a Llama / Qwen3 / Mamba-2 directory (or a GGUF file in it), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    hf_model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, **kw)
    hf_tok = AutoTokenizer.from_pretrained(str(src), **kw)
    return hf_model.eval(), hf_tok


def import_hf(src: str | Path, out: str | Path, *, gguf_file: str | None = None, overwrite: bool = False,
              **overrides) -> Path:
    """Convert a Hugging Face model directory (or ``src`` = a ``.gguf`` file) into a looplm checkpoint at ``out``.

    ``overrides`` change the imported config before the weights are copied (``n_loops=2`` loops the
    whole imported stack; shapes must stay the same). Returns ``out``.
    """
    from ..data.tokenizers import HFTokenizer

    src = Path(src)
    if src.is_file() and src.suffix == ".gguf":
        src, gguf_file = src.parent, src.name
    if not src.is_dir():
        raise FileNotFoundError(f"{str(src)!r} is not a Hugging Face model directory (or a .gguf file)")
    cfg_path = src / "config.json"
    is_export = cfg_path.is_file() and json.loads(cfg_path.read_text()).get("model_type") == "looplm"
    if is_export:
        model, tok = read_export(src)
        if overrides:
            from .remote.modeling_looplm import build_looplm_model

            new = build_looplm_model(model.config.replace(**overrides).to_dict())
            new.load_state_dict(model.state_dict())
            model = new
        origin = {"imported_from": str(src.resolve()), "imported_kind": "looplm-export"}
    else:
        if gguf_file is None and not cfg_path.is_file():
            ggufs = sorted(src.glob("*.gguf"))
            if len(ggufs) != 1:
                raise FileNotFoundError(
                    f"{str(src)!r} has no config.json" + (f" and {len(ggufs)} .gguf files: pass one" if ggufs else "")
                )
            gguf_file = ggufs[0].name
        from ..interop import from_transformers

        hf_model, hf_tok = _load_transformers(src, gguf_file)
        model = from_transformers(hf_model, **overrides).eval()
        tok = HFTokenizer(hf_tok, str(src), kind="transformers",
                          eos_token=None if hf_tok.eos_token else _guess_eos(hf_tok))
        origin = {"imported_from": str(src.resolve()) + (f"/{gguf_file}" if gguf_file else ""),
                  "imported_kind": hf_model.config.model_type}
    return write_checkpoint(out, model, tok, extra={"import": origin}, overwrite=overwrite)


def _guess_eos(hf_tok) -> str | None:
    from ..data.tokenizers import EOS_CANDIDATES

    vocab = hf_tok.get_vocab()
    return next((t for t in EOS_CANDIDATES if t in vocab), None)
