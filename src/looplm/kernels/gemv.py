"""Matrix-vector kernels for CPU decoding, and the decode-time linear layers that use them.

A decode step multiplies a handful of activation rows (the batch) by every weight matrix, so its cost
is the weight bytes read from memory (the bandwidth limit of ``benchmarks/bench_decode.py``). torch's
bf16 matmul on CPU (oneDNN) is built for matrix-matrix products and reads bf16 weights at 4–15 GB/s at
the SmolLM2-135M shapes on a 2-core Xeon that streams ~23 GB/s, which made bf16 decoding *slower* than
fp32; its fp32 GEMM (MKL) is at the bandwidth for one row but reads at 8–14 GB/s for 4–8 rows.
``csrc/gemv.cpp`` reads each weight matrix in place, once, with software prefetching: bf16 with
one row of x on AVX512-BF16 dot products (13–27 GB/s, 2–4× torch on that machine), bf16 with 2–16 rows
on AMX tiles where the CPU has them (1.1–2.6×), fp32 with 3–8 rows on AVX-512 FMA tiles (1.4–2.7×).
The decode step as a whole is measured by ``benchmarks/bench_decode.py``.

The reference is ``F.linear``: :func:`linear` uses the kernels only where they are the faster path —
CPU, bf16 or fp32 activations and weights, the row counts of :func:`kernel_wins`, no autograd — and
``F.linear`` everywhere else; ``tests/test_gemv.py`` checks every path against an fp64 product of the
same numbers.

The kernels are in the ``avx512bf16`` build of looplm's extension (:mod:`looplm.kernels.loader`: built by
``looplm kernels build``, for CPUs with AVX512-BF16; the fp32 kernel too: one build for the CPUs this was
measured on). Where the CPU lacks AVX512-BF16, :func:`available` is ``False`` and the products run on
``F.linear``; the fused decode steps of ``csrc/decode.cpp`` (:mod:`looplm.kernels.decode`) call the kernels
from C++ where they exist and torch's matmul where not.

Inside :func:`looplm.decode.generate.generate` (:func:`looplm.dispatch.decode_steps`) every plain ``nn.Linear``
with bf16 or fp32 CPU weights that a kernel serves at the call's batch size runs its one-token steps
through :func:`linear` (the decode step registered by :func:`register`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import dispatch
from .loader import amx, constant_for_compile, enabled, extension_available, kernels_available, unavailable_reason  # noqa: F401
from . import onednn
from .gemm import TunedLinear

MAX_ROWS = 16  # the AMX path's limit (one B tile holds 16 rows of x); above it torch's matmul is the path
_wins: dict[tuple[int, int, torch.dtype, int], bool] = {}


@constant_for_compile
def kernel_wins(rows: int, k: int, dtype: torch.dtype = torch.bfloat16, n: int = 0) -> bool:
    """Where the kernels beat torch's matmul (2-core Xeon with AMX, weights streamed from memory): the
    rule of ``csrc/gemv.h`` (``looplm_cpu::kernel_wins``, asked once per shape), which the fused decode
    steps apply in C++ too. ``False`` where the kernels are not built.

    bf16, one row: the AVX512-BF16 path at every shape measured (K 64-8192, N 64-151,936: 1.4-4x).
    bf16, 2-16 rows: the AMX path where the CPU has it (1.1-2.6x at K 576-8192, N 192-49,152); without
    AMX the one-row path, each weight block read once for all rows, for 2-8 rows while rows x K <= 4608
    (AMD EPYC, one thread, vs torch's matmul at N = K: 3.0x for 4 rows of K 256, 2.6x 5 x 256, 2.1x
    5 x 768, 1.4x 5 x 576, 1.1x 8 x 576 and 4 x 1024; 1.0x 5 x 1024 and 0.5x at K 4096 stay on torch),
    and for 2-8 rows of any K where the weight is small, N x K <= 2^19 (1 MB; ``n``: N, 0 = not known): 8 rows,
    one thread, AMD EPYC, weights in cache / streamed from memory after a 60 MB pass: N x K = 256 x 256
    2.2x / -, 704 x 256 1.9x, 260 x 1024 (the byte-level LMs' head) 0.9x / 2.2x, 576 x 576 1.1x.
    fp32: 1-8 rows while they fit in L1 beside the weights (rows x K <= 6144; 1.4-2.7x MKL at K 576,
    0.94x for 8 rows of K 1536). One and two rows: on the Intel Xeon MKL's one-row GEMV was at the bandwidth, but on
    a 2-core AMD EPYC (avx512_bf16, 2026-12-07) it read weights streamed from memory at 10.6-14.3 GB/s against the
    kernel's 25.7-30.6 (one row; two rows 6.2-6.5 against 30.5-31.6 GB/s; SmolLM2-135M's 1536 x 576 and
    49,152 x 576 products), which made looplm's fp32 batch-1 decode step 39 ms against vLLM's 24.
    On CPUs whose vendor is not Intel (where MKL takes its slow path) fp32 takes 1-8 rows of any K: on that AMD
    EPYC (2 threads, weights streamed from memory) MKL ran 2-8 rows at 7.6-13.9 GB/s, the kernel 1.3-2.3x that
    at every K measured (K 1024-4096, N 1024-4096: 0.47 against 1.37 ms for 8 rows of 4096 x 1024; 0.58 against
    1.36 for 8 rows of 1024 x 4096), and oneDNN in between (``benchmarks/bench_prefill.py --rows``).
    """
    if not kernels_available() or dtype not in _KERNEL_DTYPES:
        return False
    key = (rows, k, dtype, n)
    win = _wins.get(key)
    if win is None:
        win = _wins[key] = bool(torch.ops.looplm_cpu.kernel_wins(rows, k, dtype, n))
    return win


def available() -> bool:
    """Whether the GEMV kernels run here (an AVX512-BF16 CPU; loads the extension on the first call)."""
    return kernels_available()


def gemv_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, use_amx: bool = True
) -> torch.Tensor:
    """The kernels themselves: ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` (contiguous bf16, CPU) ->
    ``[M, N]``; 2-16 rows on AMX where the CPU has it, unless ``use_amx=False`` (the per-row path)."""
    if not available():
        raise RuntimeError(f"the bf16 GEMV kernel is not available: {unavailable_reason()}")
    return torch.ops.looplm_cpu.gemv_bf16(x, weight, bias, use_amx)


def gemv_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 kernel: ``x [M, K]`` with 3 <= M <= 8, ``weight [N, K]``, ``bias [N]`` (contiguous fp32, CPU)."""
    if not available():
        raise RuntimeError(f"the GEMV kernels are not available: {unavailable_reason()}")
    return torch.ops.looplm_cpu.gemv_fp32(x, weight, bias)


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def uses_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` takes a kernel for these arguments (else ``F.linear``)."""
    dt = x.dtype
    return (
        dt in _KERNEL_DTYPES
        and weight.dtype == dt
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() > 0
        and kernel_wins(x.numel() // x.shape[-1], x.shape[-1], dt, weight.shape[0])
        and available()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == dt and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]`` -> ``[..., N]``), on a kernel where it is faster (fp32 rows that
    no kernel takes: on oneDNN where :func:`looplm.kernels.onednn.applies`)."""
    if not uses_kernel(x, weight, bias):
        return onednn.linear(x, weight, bias)  # F.linear unless oneDNN applies
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    if x.dtype == torch.bfloat16:
        y = torch.ops.looplm_cpu.gemv_bf16(x2, weight, bias)  # [M, N]
    else:
        y = torch.ops.looplm_cpu.gemv_fp32(x2, weight, bias)
    return y.view(*lead, weight.shape[0])


_PLAIN_LINEARS = (nn.Linear, TunedLinear)  # TunedLinear: a model switched for training (looplm.kernels.gemm)


def _prepare_linear(lin: nn.Module, batch_size: int | None):
    """A linear layer's decode step applies where its weights are bf16 or fp32 on the CPU and a kernel serves
    the call's batch size (so e.g. bf16 at batch 32 keeps ``nn.Linear``, and its call costs nothing extra), and
    for fp32 weights wherever the prompt steps' products go to oneDNN (:func:`looplm.kernels.onednn.prefers_onednn`)."""
    w = lin.weight
    if w.dtype not in _KERNEL_DTYPES or w.device.type != "cpu" or not available():
        return None
    if w.dtype == torch.float32 and onednn.prefers_onednn():
        return True  # the prompt steps' products go to oneDNN (:mod:`looplm.kernels.onednn`) at any batch size
    if batch_size is not None and not kernel_wins(batch_size, lin.in_features, w.dtype, lin.out_features):
        return None
    return True


def _linear_step(lin: nn.Module, prepared, x: torch.Tensor):
    """One new position per sequence (``x [B, 1, K]``: a decode step) on :func:`linear`; ``None`` (the layer's
    own ``F.linear``) otherwise, except an fp32 prompt step where :func:`looplm.kernels.onednn.applies` (oneDNN
    where MKL takes its slow path). Keeping the prompt step off the GEMV kernels makes the choice depend on the
    batch size only, which a compiled decode step holds fixed, not on the prompt length (inside
    :func:`looplm.dispatch.few_token_steps` a few positions per sequence take :func:`linear` too)."""
    if x.dim() == 3 and (x.shape[1] == 1 or (dispatch.few_token_calls() and x.shape[0] * x.shape[1] <= MAX_ROWS)):
        return linear(x, lin.weight, lin.bias)
    if onednn.applies(x, lin.weight, lin.bias):  # an fp32 prompt step where MKL takes its slow path
        return onednn.linear_onednn(x, lin.weight, lin.bias)
    return None


@contextlib.contextmanager
def decode_linears(model: nn.Module, batch_size: int | None = None):
    """Only the linear layers' decode steps, for the ``with`` block (:func:`looplm.dispatch.decode_steps` with
    this module's steps; ``generate`` enters all steps at once). Yields how many layers were switched."""
    with dispatch.decode_steps(model, batch_size, only=lambda s: s.provider == PROVIDER) as counts:
        yield sum(counts.values())


def fused_linear_class(cls: type = nn.Linear) -> type:
    """The class a plain linear layer of class ``cls`` has while its decode step is switched in."""
    return dispatch.DECODE_STEPS[cls].fused_class()


PROVIDER = "looplm.kernels.gemv"


def register() -> None:
    """Register the one-token step of plain linear layers (:func:`looplm.dispatch.decode_steps`); refuses a bad
    ``LOOPLM_FP32_GEMM`` here, before any product runs."""
    onednn.prefers_onednn()
    for cls in _PLAIN_LINEARS:
        dispatch.register_decode_step(
            dispatch.DecodeStep(
                f"gemv {cls.__name__}", cls, _prepare_linear, {"forward": _linear_step}, provider=PROVIDER
            )
        )


__all__ = [
    "MAX_ROWS",
    "amx",
    "available",
    "decode_linears",
    "enabled",
    "extension_available",
    "fused_linear_class",
    "unavailable_reason",
    "gemv_bf16",
    "gemv_fp32",
    "kernel_wins",
    "linear",
    "register",
    "uses_kernel",
]
