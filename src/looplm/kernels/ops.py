"""Typed Python entry points of the extension's ops (``torch.ops.looplm_cpu.*``, defined in ``csrc/``) and
their fake kernels, which give ``torch.compile`` the output shapes so compiled code traces through them.

Every op here needs :func:`looplm.kernels.loader.load_extension`; callers check availability first
(:mod:`looplm.kernels.loader`) and keep the PyTorch reference as the path everywhere else.
"""

from __future__ import annotations

import torch

_fakes_registered = [False]


def register_fakes() -> None:
    """Shapes of every op for ``torch.compile`` (once, after the library is loaded)."""
    if _fakes_registered[0]:
        return
    _fakes_registered[0] = True
    fake = torch.library.register_fake

    @fake("looplm_cpu::gemv_bf16")
    def _(x, weight, bias=None, use_amx=True):
        return x.new_empty(x.shape[0], weight.shape[0])

    @fake("looplm_cpu::gemv_fp32")
    def _(x, weight, bias=None):
        return x.new_empty(x.shape[0], weight.shape[0])

    for name in ("decode_attention", "decode_swiglu", "decode_stack", "decode_mamba2"):
        # each writes its caches / states in place (declared in the schema) and returns a new [B, 1, d]
        fake(f"looplm_cpu::{name}")(lambda x, *args, **kwargs: torch.empty_like(x))

    @fake("looplm_cpu::decode_stateloop_update")
    def _(h, S, *args):
        return torch.empty_like(S)

    @fake("looplm_cpu::decode_stateloop_read")
    def _(h, S, *args):
        return torch.empty_like(h)

    @fake("looplm_cpu::decode_norm")
    def _(x, norm_weight, eps):
        return torch.empty_like(x)

    @fake("looplm_cpu::copy_kv_columns")
    def _(src, dst, rows, cols):  # writes dst in place (declared in the schema)
        return None

    @fake("looplm_cpu::attention_backward")
    def _(grad_out, q, k, v, out, lse, scale, is_causal):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @fake("looplm_cpu::attention_forward")
    def _(q, k, v, scale, is_causal):  # out laid out [B, T, H, hd] as a [B, H, T, hd] view, and the fp32 log-sum-exp
        B, H, T, hd = q.shape
        return q.new_empty(B, T, H, hd).transpose(1, 2), q.new_empty(B, H, T, dtype=torch.float32)

    @fake("looplm_cpu::mm_f32")
    def _(a, b):
        return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)

    @fake("looplm_cpu::cross_entropy_rows_")
    def _(z, targets, weight, grad):  # overwrites z with the gradient when grad
        return z.new_empty(z.shape[0], dtype=torch.float32)

    @fake("looplm_cpu::sum_squares")
    def _(xs):
        return xs[0].new_empty((), dtype=torch.float64)


__all__ = ["register_fakes"]
