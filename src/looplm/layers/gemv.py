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

The kernels are compiled on first use (``torch.utils.cpp_extension``: a C++ compiler and ``ninja``,
about 8 s once; cached under ``~/.cache/torch_extensions``), for CPUs with AVX512-BF16 (the fp32 kernel
too: one build for the CPUs this was measured on). Where the CPU lacks AVX512-BF16, :func:`available`
is ``False`` and the products run on ``F.linear``; the extension is then built without the kernels (the
portable build: AVX2/FMA where the CPU has them, plain C++ elsewhere), for the fused decode block of
``csrc/decode.cpp`` (:mod:`looplm.layers.decode`), which calls the kernels from C++ where they exist and
torch's matmul where not. Without a compiler, or with ``LOOPLM_CPU_KERNELS=0``, neither runs
(:func:`extension_available` and :func:`unavailable_reason` say why) and everything is the reference.

Used by :func:`looplm.generate.generate` through :func:`decode_linears`, which switches a model's
``nn.Linear`` layers to :class:`DecodeLinear` for the duration of the call.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpuinfo
from .cpu_gemm import TunedLinear

MAX_ROWS = 16  # the AMX path's limit (one B tile holds 16 rows of x); above it torch's matmul is the path
FP32_MAX_ROW_ENTRIES = 6144  # fp32 kernel: rows x K of x that stay in L1 (24 KB) beside the weight tiles


def kernel_wins(rows: int, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Where the kernels beat torch's matmul (2-core Xeon with AMX, weights streamed from memory).

    bf16, one row: the AVX512-BF16 path at every shape measured (K 64-8192, N 64-151,936: 1.4-4x).
    bf16, 2-16 rows: the AMX path where the CPU has it (1.1-2.6x at K 576-8192, N 192-49,152); without
    AMX the one-row path per row, only for 2-4 short rows (4 rows: 3x at K 256, 1.15x at K 896,
    0.67-0.78x at K 2048+). fp32: 3-8 rows while they fit in L1 beside the weights (rows x K <= 6144;
    1.4-2.7x MKL at K 576, 0.94x for 8 rows of K 1536); one row stays on MKL (at the bandwidth already).
    """
    if dtype == torch.float32:
        return 3 <= rows <= 8 and rows * k <= FP32_MAX_ROW_ENTRIES
    if rows == 1:
        return True
    if rows > MAX_ROWS:
        return False
    return amx() or (rows <= 4 and rows * k < 4096)


def amx() -> bool:
    """Whether the 2-16-row bf16 path runs on AMX tiles here (CPU flags and the process's permission to
    use them; decided once, whatever :func:`enabled` says at the time)."""
    if "amx" not in _state:
        extension_available()  # builds the extension on the first call
        _state["amx"] = _state["ok"] and _state.get("kernels", False) and bool(torch.ops.looplm_cpu.amx_ready())
    return _state["amx"]


_lock = threading.Lock()
_state: dict = {}  # "ok": extension built; "reason": why not; "kernels": it has the GEMV kernels; "variant"
_enabled = True
_KERNEL_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}


def _variant() -> tuple[str, list[str]]:
    """Which build this CPU gets, and its compiler flags: the kernels where the CPU has AVX512-BF16 (AMX
    where it has AMX too), else the portable build (the fused decode block, with torch's matmul for the
    products), with AVX2/FMA where the CPU has them. ``LOOPLM_CPU_KERNELS=portable`` forces the
    portable build (tests, comparisons)."""
    flags = cpuinfo.flags()
    omp = ["-fopenmp"] if sys.platform.startswith("linux") else []  # at::parallel_for's OpenMP regions
    if _KERNEL_FLAGS <= flags and os.environ.get("LOOPLM_CPU_KERNELS") != "portable":
        return "avx512bf16", ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", *omp]
    if {"avx2", "fma"} <= flags:
        return "avx2", ["-O3", "-mavx2", "-mfma", *omp]
    return "portable", ["-O3", *omp]


def _build() -> tuple[bool, str]:
    if os.environ.get("LOOPLM_CPU_KERNELS", "1") == "0":
        return False, "disabled by LOOPLM_CPU_KERNELS=0"
    variant, cflags = _variant()
    _state["variant"], _state["kernels"] = variant, variant == "avx512bf16"
    try:
        from torch.utils.cpp_extension import load

        csrc = Path(__file__).with_name("csrc")
        load(
            name=f"looplm_cpu_{variant}",  # one name per build: a cache shared by several CPUs never mixes them
            # decode.cpp: the fused decode block (layers/decode.py); attention.cpp and loss.cpp: the attention
            # backward and the cross-entropy rows of training (layers/attention.py, layers/loss.py); reduce.cpp:
            # the gradient norm (train/grad_norm.py)
            sources=[str(csrc / f) for f in ("gemv.cpp", "decode.cpp", "attention.cpp", "loss.cpp", "reduce.cpp")],
            extra_include_paths=[str(csrc)],
            extra_cflags=cflags,
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a read-only cache directory, ...
        return False, f"could not build looplm's CPU extension ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''})"

    @torch.library.register_fake("looplm_cpu::gemv_bf16")
    def _(x, weight, bias=None, use_amx=True):  # shapes for torch.compile (compiled blocks trace through it)
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("looplm_cpu::gemv_fp32")
    def _(x, weight, bias=None):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("looplm_cpu::decode_attention")
    def _(x, *args):  # writes the caches in place (declared in the schema), returns a new [B, 1, d]
        return torch.empty_like(x)

    @torch.library.register_fake("looplm_cpu::decode_swiglu")
    def _(x, *args):
        return torch.empty_like(x)

    @torch.library.register_fake("looplm_cpu::decode_stack")
    def _(x, *args):  # writes every block's caches in place (declared in the schema), returns a new [B, 1, d]
        return torch.empty_like(x)

    @torch.library.register_fake("looplm_cpu::decode_mamba2")
    def _(x, *args):  # updates conv_state and ssm_state in place
        return torch.empty_like(x)

    @torch.library.register_fake("looplm_cpu::attention_backward")
    def _(grad_out, q, k, v, out, lse, scale, is_causal):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @torch.library.register_fake("looplm_cpu::attention_forward")
    def _(q, k, v, scale, is_causal):  # out laid out [B, T, H, hd] as a [B, H, T, hd] view, and the fp32 log-sum-exp
        B, H, T, hd = q.shape
        return q.new_empty(B, T, H, hd).transpose(1, 2), q.new_empty(B, H, T, dtype=torch.float32)

    @torch.library.register_fake("looplm_cpu::mm_f32")
    def _(a, b):
        return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)

    @torch.library.register_fake("looplm_cpu::cross_entropy_rows_")
    def _(z, targets, weight, grad):  # overwrites z with the gradient when grad
        return z.new_empty(z.shape[0], dtype=torch.float32)

    return True, ""


def extension_available() -> bool:
    """Whether looplm's CPU extension runs here — the fused decode block (:mod:`looplm.layers.decode`)
    on any CPU with a compiler, plus the GEMV kernels where :func:`available` (built on the first call;
    thread-safe)."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _state["ok"], _state["reason"] = _build()
    return _state["ok"] and _enabled


@torch.compiler.assume_constant_result  # compiled code asks once, at tracing: the answer is a fact of the build
def kernels_built() -> bool:
    """:func:`available`, for code that torch.compile traces (the training layers' dispatch)."""
    return available()


@torch.compiler.assume_constant_result
def mkl_gemm_ready() -> bool:
    """The AVX-512 build is loaded and torch links the MKL GEMMs its training ops call (``csrc/attention.cpp``:
    the attention forward / backward and ``mm_f32``); for code that torch.compile traces."""
    return available() and bool(torch.ops.looplm_cpu.attention_backward_ready())


def available() -> bool:
    """Whether the GEMV kernels run here (an AVX512-BF16 CPU; built on the first call; thread-safe)."""
    return extension_available() and _state.get("kernels", False)


def unavailable_reason() -> str:
    """Why :func:`available` is ``False`` (empty when it is ``True``)."""
    extension_available()
    if not _state["ok"]:
        return _state["reason"]
    if not _enabled:
        return "switched off with looplm.layers.gemv.enabled(False)"
    if not _state.get("kernels", False):
        missing = _KERNEL_FLAGS - cpuinfo.flags()
        why = f"this CPU lacks {', '.join(sorted(missing))}" if missing else "LOOPLM_CPU_KERNELS=portable"
        return f"{why}: the portable build runs the fused decode block, with torch's matmul for the products"
    return ""


@contextlib.contextmanager
def enabled(on: bool):
    """Switch the kernel on or off inside a ``with`` block (benchmarks compare both in one process)."""
    global _enabled
    prev, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = prev


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, use_amx: bool = True) -> torch.Tensor:
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
        and kernel_wins(x.numel() // x.shape[-1], x.shape[-1], dt)
        and available()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == dt and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]`` -> ``[..., N]``), on a kernel where it is faster."""
    if not uses_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    if x.dtype == torch.bfloat16:
        y = torch.ops.looplm_cpu.gemv_bf16(x2, weight, bias)  # [M, N]
    else:
        y = torch.ops.looplm_cpu.gemv_fp32(x2, weight, bias)
    return y.view(*lead, weight.shape[0])


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` for one new position per sequence (``x [B, 1, K]``:
    a decode step) and ``F.linear`` otherwise (same parameters, same state dict). Keeping the prompt
    step on ``F.linear`` makes the choice depend on the batch size only, which a compiled decode step
    holds fixed, not on the prompt length (no extra graphs for short prompts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1:
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


_PLAIN_LINEARS = (nn.Linear, TunedLinear)  # TunedLinear: a model switched for training (train.cpu_gemm)


@contextlib.contextmanager
def decode_linears(model: nn.Module, batch_size: int | None = None):
    """Inside the block, the plain ``nn.Linear`` layers of ``model`` with bf16 or fp32 CPU weights run as
    :class:`DecodeLinear`; the classes are restored on exit. With ``batch_size`` (rows of a decode step),
    only the layers a kernel serves at that batch size (:func:`kernel_wins`), so e.g. fp32 at batch 1
    keeps ``nn.Linear`` and its call costs nothing extra. A no-op where the kernels are unavailable (and
    models on other devices or in other dtypes never build them)."""
    swapped = [
        m for m in model.modules()
        if type(m) in _PLAIN_LINEARS and m.weight.dtype in _KERNEL_DTYPES and m.weight.device.type == "cpu"
    ]  # fmt: skip
    if not swapped or not available():
        swapped = []
    if batch_size is not None:
        swapped = [m for m in swapped if kernel_wins(batch_size, m.in_features, m.weight.dtype)]
    classes = [type(m) for m in swapped]
    for m in swapped:
        m.__class__ = DecodeLinear
    try:
        yield len(swapped)
    finally:
        for m, cls in zip(swapped, classes):
            m.__class__ = cls
