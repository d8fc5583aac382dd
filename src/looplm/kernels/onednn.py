"""fp32 prompt products on oneDNN where torch's fp32 GEMM (MKL) takes its slow path: a prefill's linear layers.

Why: torch's CPU wheel runs an fp32 ``F.linear`` on MKL, and MKL picks its code path by CPU *vendor*: on an
AMD EPYC with AVX-512 (2 cores, torch 2.13.0, 2026-12-07) it ran the products of a prefill at 140-200 GFLOP/s,
against 310-450 for oneDNN (which torch also ships, and which dispatches on the CPU's features) on the same
numbers — 2.0-2.3x at 48 and 384 rows for SmolLM2-135M's 576 x 576, 1536 x 576 and 576 x 1536 and for the
d = 1024 LM's 4096 x 1024, and 3.0-3.5x for 9-32 rows of the 49,152 x 576 head (``benchmarks/bench_prefill.py``).
That made an fp32 prompt of 48 tokens take twice vLLM's time to first token (vLLM's CPU build calls oneDNN).

So the prompt step of a decode (:func:`looplm.kernels.gemv.register`'s linear step, inside
:func:`looplm.dispatch.decode_steps`: ``generate`` and ``looplm serve``) runs an fp32 product of more rows than
the GEMV kernels take on oneDNN (``torch.ops.mkldnn._linear_pointwise``: one oneDNN inner product, the bias
inside it) where :func:`prefers_onednn` says so. The reference is ``F.linear``; ``tests/test_onednn.py`` holds
both to an fp64 product of the same numbers, and checks that a row's result does not depend on the rows beside
it (a prompt batched with others gets the numbers it gets alone: oneDNN's kernel for 9 or more rows is one and
the same).

Where: ``LOOPLM_FP32_GEMM`` = ``onednn`` or ``mkl`` forces one; ``auto`` (the default) takes oneDNN on CPUs whose
vendor is not Intel (MKL's fast paths are Intel's) and MKL on Intel's, where it was measured at the bandwidth
and at the FMA peak. Training (autograd), bf16 (already oneDNN in torch) and other devices are untouched.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..utils import cpuinfo

ENV = "LOOPLM_FP32_GEMM"
CHOICES = ("auto", "onednn", "mkl")
MIN_ROWS = 9  # oneDNN's inner product of 1-8 rows is another kernel (rounded differently); the GEMV kernels take those


def _setting() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} (unset means auto)")
    return value


def prefers_onednn() -> bool:
    """Whether fp32 prompt products go to oneDNN here: ``LOOPLM_FP32_GEMM`` (``onednn`` / ``mkl``), else (``auto``)
    on a CPU whose vendor is not ``GenuineIntel`` and where torch has oneDNN (read on every call: cheap)."""
    setting = _setting()
    if setting == "mkl" or not torch.backends.mkldnn.is_available():
        return False
    return setting == "onednn" or cpuinfo.vendor() not in (None, "GenuineIntel")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs these arguments on oneDNN (else ``F.linear``): fp32 on the CPU, at least
    :data:`MIN_ROWS` rows, no autograd, and :func:`prefers_onednn`."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() >= 2
        and x.numel() // max(x.shape[-1], 1) >= MIN_ROWS
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and prefers_onednn()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]`` -> ``[..., N]``), on oneDNN where :func:`applies`."""
    return linear_onednn(x, weight, bias) if applies(x, weight, bias) else F.linear(x, weight, bias)


def linear_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oneDNN product itself, for a caller that has asked :func:`applies` already."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    y = torch.ops.mkldnn._linear_pointwise(x2, weight.contiguous(), bias, "none", [], "")  # [M, N]
    return y.view(*lead, weight.shape[0])


__all__ = ["CHOICES", "ENV", "MIN_ROWS", "applies", "linear", "linear_onednn", "prefers_onednn"]
