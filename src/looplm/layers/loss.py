"""The language-model head and its cross-entropy, chunked over tokens so that the ``[N, V]`` logits
never exist in full.

The plain path — ``F.cross_entropy(F.linear(h, W).float(), y)`` — materialises the logits in the
compute dtype, again in fp32 for the log-softmax, and keeps both for the backward pass. At the
StateLoop 1.4B shape (vocabulary 50,432, 8 × 2048 tokens per micro-batch) the fp32 logits alone are
3.3 GB. :func:`linear_cross_entropy` instead walks over chunks of ``chunk_size`` tokens and, for each
chunk, computes the logits, the loss *and* the gradients with respect to ``h`` and ``W`` at once
(the gradient of the mean loss is ``(softmax(z) − onehot(y)) / n``), then drops the chunk's logits.
The backward pass only scales the stored gradients by the incoming gradient, so nothing is
recomputed. Peak extra memory is one chunk of logits plus one gradient of ``h`` and of ``W``.

:func:`linear_cross_entropy_reference` is the readable unchunked form it is tested against.

Each chunk — its logits, softmax, loss and gradients — is one call of :data:`loss_chunk`, a dispatch
point (:mod:`looplm.dispatch`) whose reference is the PyTorch code below. (looplm's CPU path registers the
same formulas with the products in the measured fastest split and the softmax of each chunk as one C++ op,
each row read twice and written once: :mod:`looplm.kernels.training`.)

(Why not a library kernel: the fused kernels in the ecosystem — Liger, Apple's cut-cross-entropy —
are Triton / CUDA only, and this has to run on CPU too; a chunked PyTorch version is small.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``h [N, d] @ weight[V, d]ᵀ`` against ``targets [N]`` (``-100`` ignored)."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul would run in: the autocast dtype when autocast is on, else the inputs'."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


# Rows of logits per softmax block on a CPU: 16 × 50k fp32 = 3 MB, about what a core's caches hold.
# On CUDA one block is the whole chunk (few large kernels; the caching allocator makes buffers cheap).
_CPU_ROWS = 16


def _chunk_softmax_(z, targets, valid, scale, acc, need_grad) -> torch.Tensor:
    """The summed loss of one chunk of logits ``z [n, V]`` (``targets``, ``valid`` ``[n]`` its rows'); with
    ``need_grad`` z is overwritten with d(mean loss)/dz (``scale`` = 1 / the batch's valid rows)."""
    loss = torch.zeros((), dtype=acc, device=z.device)
    # The softmax runs over blocks of rows in acc: a block's fp32 copy is small enough
    # to stay in cache, and the gradient is written back into z's own buffer, so no [n, V]
    # fp32 tensor is allocated (on a CPU each fresh one costs as much as a matmul).
    n = z.shape[0]
    rows = _CPU_ROWS if z.device.type == "cpu" else n
    for r in range(0, n, rows):
        zb = z[r : r + rows]  # [b, V] view
        zf = zb.to(acc)  # [b, V]; zb itself when z is already in acc
        ok = valid[r : r + zb.shape[0], None]  # [b, 1]
        y = torch.where(ok, targets[r : r + zb.shape[0], None], 0)  # [b, 1]
        m = zf.amax(dim=-1, keepdim=True)  # [b, 1]
        zy = zf.gather(1, y)  # [b, 1] the target's logit
        ez = zf.sub_(m).exp_()  # [b, V] exp(z − max), in place
        se = ez.sum(dim=-1, keepdim=True)  # [b, 1]
        loss = loss + torch.where(ok, m + se.log() - zy, 0.0).sum()  # Σ valid rows of lse − z_y
        if need_grad:
            # d(mean loss)/dz = (softmax(z) − onehot(y)) · rs, rs = 1/n_valid (0 on ignored rows)
            rs = ok.to(acc) * scale  # [b, 1]
            py = ez.gather(1, y) / se  # [b, 1] softmax at the target
            ez.mul_(rs / se)
            if ez is not zb:
                zb.copy_(ez)  # back into the matmul dtype, in z's buffer
            zb.scatter_(1, y, ((py - 1.0) * rs).to(z.dtype))
    return loss


def _loss_chunk_reference(h, w, targets, valid, scale, acc, need_grad):
    """One chunk of the chunked loss: ``h [n, d]`` (rows of the batch, in the matmul dtype), ``w [V, d]``,
    ``targets`` / ``valid`` ``[n]``. Returns ``(loss, grad_h, grad_w)``: the chunk's summed loss (``acc``)
    and, with ``need_grad``, d(mean loss)/dh ``[n, d]`` (matmul dtype) and d(mean loss)/dW ``[V, d]`` (acc)."""
    z = h @ w.t()  # [n, V] logits of this chunk only, in the matmul dtype
    loss = _chunk_softmax_(z, targets, valid, scale, acc, need_grad)  # z becomes the logits' gradient
    if not need_grad:
        return loss, None, None
    return loss, z @ w, (z.t() @ h).to(acc)  # [n, d], [V, d]


loss_chunk = dispatch.Op("loss_chunk", _loss_chunk_reference, "one chunk of the chunked head + cross-entropy")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size):
        # h [N, d], weight [V, d], targets [N]
        dtype = _compute_dtype(h, weight)
        acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: fp32 (fp64 stays fp64)
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            valid = targets != -100  # [N]
            n_valid = valid.sum()
            scale = 1.0 / n_valid.clamp(min=1).to(acc)
            need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            grad_h = torch.empty_like(hc) if need_grad else None  # [N, d]
            grad_w = None  # [V, d] in acc, the sum over chunks
            loss = torch.zeros((), dtype=acc, device=h.device)
            for s in range(0, h.shape[0], chunk_size):
                e = min(s + chunk_size, h.shape[0])
                ls, gh, gw = loss_chunk(hc[s:e], wc, targets[s:e], valid[s:e], scale, acc, need_grad)
                loss = loss + ls
                if need_grad:
                    grad_h[s:e] = gh.to(grad_h.dtype)  # [n, d]
                    grad_w = gw if grad_w is None else grad_w.add_(gw)  # [V, d]
            if need_grad and grad_w is None:  # no tokens at all
                grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            loss = loss / n_valid.to(acc)  # nan when every target is ignored, like F.cross_entropy
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        # Scaled in place: the buffers are this function's own, and a second backward through a
        # retained graph is refused by autograd's version check instead of scaling them twice.
        grad_h, grad_w = ctx.saved_tensors
        # The usual incoming gradient is exactly 1 (loss.backward()): on a CPU, where reading it costs no
        # device sync, the pass over the [V, d] gradient is skipped then (x · 1 = x bit for bit).
        one = grad_out.device.type == "cpu" and not torch.compiler.is_compiling() and grad_out.item() == 1.0
        gh = (grad_h if one else grad_h.mul_(grad_out)).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w if one else grad_w.mul_(grad_out)).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


# Tokens per chunk when none is given. Measured at the StateLoop 1.4B head (8 × 2048 tokens, d 2048,
# V 50,432, bf16) on an H200: plain 24 ms / 9.7 GB extra peak, chunks of 1024 36 ms / 2.0 GB, of 4096
# 27.5 ms / 3.5 GB (benchmarks/check_cuda.py). On a CPU, 1024 (a [1024, V] block per chunk).
DEFAULT_CHUNK = {"cuda": 4096}
DEFAULT_CHUNK_CPU = 1024


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weightᵀ`` against ``targets``, without materialising them.

    ``h [..., d]``, ``weight [V, d]``, ``targets [...]`` (``-100`` = ignored); ``chunk_size`` tokens per
    chunk (default: 4096 on CUDA, 1024 elsewhere). Equal to :func:`linear_cross_entropy_reference`
    (loss and gradients) up to float summation order.
    """
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK.get(h.device.type, DEFAULT_CHUNK_CPU)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk_size)


__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "loss_chunk"]
