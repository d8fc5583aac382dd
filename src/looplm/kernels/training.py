"""looplm's CPU training ops behind the dispatch points of the reference model (:mod:`looplm.dispatch`).

* ``attention`` — :class:`CPUAttention`: torch's CPU flash forward (bf16; looplm's own in fp32) with
  looplm's backward (``csrc/attention.cpp``; torch 2.13's CPU flash backward is ~9× its forward at the
  SmolLM2-135M shape), for attention that autograd will differentiate;
* ``loss_chunk`` — the chunked head's products in the measured fastest split (:func:`looplm.kernels.gemm.mm`,
  an fp32 weight gradient straight from MKL's bf16 GEMM: :func:`~looplm.kernels.gemm.mm_f32`) and the
  softmax cross-entropy of each chunk's rows as one op (``csrc/loss.cpp``: ``cross_entropy_rows_``);
* ``grad_norm`` — the global gradient norm in one op (``csrc/reduce.cpp``: fp32 runs summed in fp64).

Each falls back to the op's reference where it does not apply; the references are the tests' baselines
(``tests/test_training_kernels.py``, ``tests/test_grad_norm.py``).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..layers.loss import _chunk_softmax_
from .loader import extension_available, kernels_available, mkl_gemm_ready
from .gemm import mm, mm_f32


def _reference(name: str):
    return dispatch.OPS[name].reference


class CPUAttention(torch.autograd.Function):
    """Softmax attention ``softmax(q kᵀ / √hd + causal mask) v`` on CPU with looplm's backward.

    Forward: in bf16 torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, what
    SDPA runs on a CPU: the training forward equals the inference one bit for bit), which also returns the
    log-sum-exp ``L`` of each query row; in fp32 ``looplm_cpu::attention_forward`` (the same quantities
    from two MKL products per query block, 1.6x the flash kernel there; equal to it to fp32 rounding). Backward:
    ``looplm_cpu::attention_backward`` (``csrc/attention.cpp``): for each (batch row, key/value head)
    the query heads sharing it recompute ``P = exp(q kᵀ/√hd − L)`` block by block in fp32 and take
    ``dV = Pᵀ dO``, ``dS = P ⊙ (dO vᵀ − rowsum(dO ⊙ O)) / √hd``, ``dQ = dS k``, ``dK = dSᵀ q`` with
    the MKL GEMM torch links (bf16 in, fp32 out; dK, dV summed in fp32 over the group). Equal to SDPA's
    gradients up to float rounding (``tests/test_training_kernels.py``). ``q [B, H, T, hd]``,
    ``k, v [B, H_kv, S, hd]`` (``H_kv`` dividing ``H``), one dtype (bf16 or fp32).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool):
        scale = q.shape[-1] ** -0.5
        if q.dtype == torch.float32:  # looplm's forward: 1.6x torch's flash kernel in fp32 (equal speed in bf16)
            out, lse = torch.ops.looplm_cpu.attention_forward(q, k, v, scale, is_causal)
        else:  # bf16: the flash kernel, so that a training forward is bit for bit the inference one
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)  # out [B, H, T, hd], lse [B, H, T] fp32
        ctx.scale, ctx.is_causal = scale, is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = torch.ops.looplm_cpu.attention_backward(grad_out, q, k, v, out, lse, ctx.scale, ctx.is_causal)
        return dq, dk, dv, None


def cpu_backward_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, is_causal: bool) -> bool:
    """Whether :func:`attention` takes :class:`CPUAttention`: autograd will differentiate the call, the
    tensors are all bf16 or all fp32 on a CPU, there is no explicit mask, causal attention has as many keys as
    queries, and the extension was built with its AVX-512 kernels (the portable build's plain-loop
    softmax measured no faster than torch's backward in fp32, so SDPA stays there; only the AVX-512 build
    registers this op)."""
    if q.device.type != "cpu" or attn_mask is not None or not torch.is_grad_enabled():
        return False
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    return q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16) and mkl_gemm_ready()


def attention(q, k, v, attn_mask=None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """The ``attention`` dispatch op (:mod:`looplm.layers.attention`): :class:`CPUAttention` where
    :func:`cpu_backward_applies`, else the reference (SDPA). Under autocast the inputs are cast to the
    autocast dtype first, as autocast does for SDPA."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if cpu_backward_applies(q, k, v, attn_mask, is_causal):
        return CPUAttention.apply(q, k, v, is_causal)
    return _reference("attention")(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def loss_chunk(h, w, targets, valid, scale, acc, need_grad):
    """The ``loss_chunk`` dispatch op (:mod:`looplm.layers.loss`) on a CPU: the products through
    :func:`~looplm.kernels.gemm.mm` / :func:`~looplm.kernels.gemm.mm_f32`, and the chunk's softmax as one
    op where the AVX-512 build is loaded (its portable plain loops are slower than the PyTorch loop)."""
    if h.device.type != "cpu":
        return _reference("loss_chunk")(h, w, targets, valid, scale, acc, need_grad)
    z = mm(h, w.t())  # [n, V] logits of this chunk only, in the matmul dtype
    if acc == torch.float32 and targets.dtype == torch.long and kernels_available():
        loss = torch.ops.looplm_cpu.cross_entropy_rows_(
            z, targets.contiguous(), scale, need_grad
        ).sum()  # z -> dz in place
    else:
        loss = _chunk_softmax_(z, targets, valid, scale, acc, need_grad)
    if not need_grad:
        return loss, None, None
    return loss, mm(z, w), mm_f32(z.t(), h).to(acc)  # [n, d]; [V, d] fp32 straight from the GEMM on a bf16 CPU


def grad_norm_applies(grads: list[torch.Tensor]) -> bool:
    """Whether :func:`grad_norm` takes the op: dense contiguous fp32 / bf16 CPU gradients, the extension loaded."""
    return (
        bool(grads)
        and extension_available()
        and all(
            type(g) is torch.Tensor  # not a DTensor (FSDP2) or another subclass
            and g.device.type == "cpu"
            and g.layout == torch.strided
            and g.dtype in (torch.float32, torch.bfloat16)
            and g.is_contiguous()
            for g in grads
        )
    )


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The ``grad_norm`` dispatch op (:mod:`looplm.train.grad_norm`): one op of the extension (squares summed
    in fp32 runs of 16 per SIMD lane, the runs added in fp64, both cores, the result independent of the thread
    count) where :func:`grad_norm_applies`; else the reference (``get_total_norm``)."""
    if grad_norm_applies(grads):
        return torch.ops.looplm_cpu.sum_squares(grads).sqrt().float()
    return _reference("grad_norm")(grads)


def register() -> None:
    """Serve ``attention`` (AVX-512 build with MKL), ``loss_chunk`` and ``grad_norm`` (any CPU build)."""
    if mkl_gemm_ready():
        dispatch.register("attention", attention, "looplm.kernels.training")
    dispatch.register("loss_chunk", loss_chunk, "looplm.kernels.training")
    if extension_available():
        dispatch.register("grad_norm", grad_norm, "looplm.kernels.training")


__all__ = [
    "CPUAttention",
    "attention",
    "cpu_backward_applies",
    "grad_norm",
    "grad_norm_applies",
    "loss_chunk",
    "register",
]
