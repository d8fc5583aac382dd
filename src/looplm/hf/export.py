"""``looplm export hf``: a looplm checkpoint as a self-contained Hugging Face model directory.

The directory holds everything ``transformers`` needs, offline, with only ``torch`` and ``transformers``
installed (looplm need not be)::

    config.json              LoopLMConfig: the looplm ModelConfig (rule name + options included) and the
                             fields tools read (heads, widths, (p, s, K, c), num_loops, exit_threshold, ...),
                             special ids, auto_map -> the files below
    model.safetensors        the weights under "looplm.<looplm name>" (a tied head stored once)
    modeling_looplm.py       the remote-code model (looplm/hf/remote/modeling_looplm.py)
    configuration_looplm.py  the remote-code config class
    looplm_*.py              looplm's own plain-PyTorch model code — config, layers, blocks, every recurrence
                             rule, cache, model, generate — copied flat from looplm's source at export time
                             (looplm/hf/bundle.py; no kernels, trainer, data or eval code), and
                             looplm_manifest.py: what was carried, from which source (its SHA-256)
    generation_config.json   eos / pad / bos ids
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja
                             the tokenizer as the source had it (chat template, special tokens), loadable
                             by AutoTokenizer without custom code

so ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(OUT)`` load it. The exported logits equal looplm's bit for bit (the code
is looplm's); with looplm installed at the export's source, the export runs on it (and its fast paths).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
PREFIX = "looplm."


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The looplm state dict under the export's names; a tied head is stored once (as the embedding)."""
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_embeddings:
            continue
        sd[PREFIX + k] = v.detach().to("cpu").contiguous()
    return sd


def export_hf(
    source,
    out: str | Path,
    *,
    tokenizer=None,
    num_loops: int | None = None,
    exit_threshold: float | None = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory for ``source``.

    Args:
        source: a checkpoint directory or run directory written by ``looplm train --out`` (or by
            ``looplm import hf``), or a ``LoopedLM`` (then pass ``tokenizer``).
        out: the output directory (created; must be empty unless ``overwrite``).
        tokenizer: a looplm tokenizer or spec; default: the one the checkpoint recorded.
        num_loops, exit_threshold: inference defaults written into the config (``None`` = the
            training loop count / the rule's own threshold).
        dtype: cast the weights (e.g. ``"bfloat16"``); default: as stored.
    """
    from ..data.tokenizers import load_tokenizer
    from .remote.configuration_looplm import LoopLMConfig

    if isinstance(source, (str, Path)):
        from ..checkpoint_io import load_model_for_inference, resolve_checkpoint
        from .weights import refuse_overlap

        refuse_overlap(resolve_checkpoint(source), out, "export")
        model, tok = load_model_for_inference(source, tokenizer=tokenizer)
    else:
        model = source
        if tokenizer is None:
            raise ValueError("export_hf(model, ...) needs tokenizer=... (a looplm tokenizer or a spec such as 'byte')")
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    gated = "exit_threshold" in getattr(model.rule, "loop_options", ())  # the rule reads an exit threshold
    if exit_threshold is not None and not gated:
        raise ValueError(
            f"exit_threshold {exit_threshold}: this model has no exit gate (its recurrence rule is "
            f"{model.config.rule.name!r}); leave it out"
        )
    if exit_threshold is not None and (
        isinstance(exit_threshold, bool)
        or not isinstance(exit_threshold, (int, float))
        or not 0.0 <= exit_threshold <= 1.0
    ):  # NaN fails too (and is not JSON)
        raise ValueError(
            f"exit_threshold must be a number in [0, 1] (the exit gate's rule: options.threshold), "
            f"got {exit_threshold!r}"
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) or another directory"
        )
    if num_loops is not None and (isinstance(num_loops, bool) or not isinstance(num_loops, int) or num_loops < 1):
        raise ValueError(f"num_loops must be an int >= 1, got {num_loops!r}")
    dt_ = getattr(torch, str(dtype).removeprefix("torch."), None) if dtype is not None else None
    if dtype is not None and not (
        isinstance(dt_, torch.dtype) and dt_.is_floating_point
    ):  # int8 would truncate every weight
        raise ValueError(f"dtype must be a floating-point torch dtype such as 'bfloat16', got {dtype!r}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("looplm_*.py"), out / "modeling_looplm.py", out / "configuration_looplm.py"]:
        stale.unlink(missing_ok=True)  # a previous export's code (--overwrite): only this source's files stay

    import looplm

    from .bundle import write_bundle

    mcfg = model.config
    if exit_threshold is None and gated:  # its own default, for tools reading the config
        exit_threshold = getattr(model.rule, "threshold", None)
    cfg = LoopLMConfig(
        looplm=mcfg.to_dict(),
        num_loops=num_loops if num_loops is not None else mcfg.n_loops,
        exit_threshold=exit_threshold,
        looplm_version=getattr(looplm, "__version__", None),
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id if tok.pad_id is not None else tok.eos_id,
    )
    cfg.architectures = ["LoopLMForCausalLM"]
    cfg.auto_map = {
        "AutoConfig": "configuration_looplm.LoopLMConfig",
        "AutoModelForCausalLM": "modeling_looplm.LoopLMForCausalLM",
    }
    cfg.looplm_tokenizer = "byte" if getattr(tok, "name", None) == "byte" else None
    sd = hf_state_dict(model)
    if dtype is not None:
        dt = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
        sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
        cfg.dtype = str(dt).removeprefix("torch.")
    else:
        cfg.dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    cfg.save_pretrained(str(out))
    _strip_config(out / "config.json")

    from safetensors.torch import save_file

    save_file(sd, str(out / WEIGHTS), metadata={"format": "pt"})
    write_bundle(out, version=getattr(looplm, "__version__", None))

    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(str(out))
    from .tokenizer import save_pretrained_tokenizer

    save_pretrained_tokenizer(tok, out)
    return out


def _strip_config(path: Path) -> None:
    """Record the weights' dtype under both names (``dtype``: transformers >= 4.56, ``torch_dtype``: older)."""
    cfg = json.loads(path.read_text())
    if cfg.get("dtype") is not None:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
