"""What machine a benchmark ran on: every benchmark table names its CPU and whether bf16 is native."""

from __future__ import annotations


def cpu_name() -> str:
    """The ``model name`` of /proc/cpuinfo (``unknown CPU`` elsewhere)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it bf16 is 7-30x slower."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_flags() -> str:
    """``avx512_bf16=yes, amx_bf16=no`` style summary."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    return ", ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx512_bf16", "amx_bf16"))


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA) before reading a clock; nothing on a CPU."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
