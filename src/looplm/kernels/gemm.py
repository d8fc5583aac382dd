"""The matrix products of bf16 training on a CPU, each run in the split that oneDNN does fastest.

Why: torch's bf16 matmul on a CPU is oneDNN, whose speed at a fixed amount of work depends on the shape in
ways no simple rule captures. At the SmolLM2-135M training shape (1024 tokens, d 576, SwiGLU 1536) on a
2-core Xeon with AMX, ``[1024, 576] @ [576, 576]`` runs at 1.4-1.6 TFLOP/s while ``[1024, 576] @ [576, 512]``
runs at 2.5, and computing the first as two products of 512 rows (or of 288 columns) each, written into
one output, runs at 2.3. So every product here is done in one of three ways —

* ``direct``: ``a @ b``;
* ``rows2``:  the two halves of ``a``'s rows, each ``@ b``, into the halves of one ``[M, N]`` output;
* ``cols2``:  ``a @`` each half of ``b``'s columns, into the halves of the output's columns —

whichever measured fastest the first time its (shape, layout, dtype, thread count) came up (the best of
five runs each; about a hundred milliseconds once per shape). Each output element is one oneDNN dot
product in every form, so the choice moves results by float rounding at most (oneDNN may block K
differently per shape); to keep a run and its resumption bit-identical, the choices are kept on disk
(``$XDG_CACHE_HOME/looplm/cpu_gemm_plans.json`` or ``$LOOPLM_CPU_GEMM_PLANS``, per CPU model, torch
version and thread count) and reused.

:func:`tuned_linears` switches a model's ``nn.Linear`` layers to :class:`TunedLinear` (the trainer does it
for bf16 training on a CPU: ``train.cpu_gemm``), whose forward and input-gradient products (``x Wᵀ``,
``dy W``) go through :func:`mm` — the op ``looplm::tuned_mm``, so compiled blocks keep it in their graph —
and whose weight gradient ``dyᵀ x`` comes from :func:`mm_f32`: MKL's bf16 GEMM with an fp32 result
(2.1-2.5 TFLOP/s at these shapes in isolation, where torch's bf16 matmul and a cast to fp32 ran at
0.9-1.5), handed to the fp32 master weight without a bf16 rounding. Products with a side under 128,
other dtypes and other devices are plain matmuls.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import dispatch
from ..utils import cpuinfo
from .loader import mkl_gemm_ready

STRATEGIES = ("direct", "rows2", "cols2")
MIN_SIDE = 128  # smaller products are overhead-bound: always direct (and tiny test models never tune)
_REPEATS = 5

_lock = threading.Lock()
_plans: dict[str, str] | None = None  # key -> strategy, loaded from disk on first use
_fast: dict[tuple, str] = {}  # (shapes, strides, dtype, threads) -> strategy: the per-call lookup


def _run(a: torch.Tensor, b: torch.Tensor, strategy: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` in ``strategy`` (the bias added inside the product, as
    ``F.linear`` does: one rounding)."""
    if strategy == "direct":
        return a @ b if bias is None else torch.addmm(bias, a, b)
    M, N = a.shape[0], b.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if strategy == "rows2":
        h = M // 2
        for r in (slice(0, h), slice(h, M)):  # [h, N], [M - h, N]
            if bias is None:
                torch.mm(a[r], b, out=out[r])
            else:
                torch.addmm(bias, a[r], b, out=out[r])
    else:  # cols2
        h = N // 2
        for c in (slice(0, h), slice(h, N)):  # [M, h], [M, N - h]: rows of stride N
            if bias is None:
                torch.mm(a, b[:, c], out=out[:, c])
            else:
                torch.addmm(bias[c], a, b[:, c], out=out[:, c])
    return out


def forget() -> None:
    """Drop the choices this process remembers (the file stays; the next product reads it again)."""
    global _plans
    with _lock:
        _plans = None
        _fast.clear()


def _layout(t: torch.Tensor) -> str:
    """``n`` (rows contiguous), ``t`` (a transposed view: columns contiguous), or ``s`` (other strides)."""
    if t.stride(1) == 1:
        return "n"
    if t.stride(0) == 1:
        return "t"
    return "s"


def _key(a: torch.Tensor, b: torch.Tensor) -> str:
    M, K = a.shape
    return f"{M}x{K}x{b.shape[1]}:{_layout(a)}{_layout(b)}:{str(a.dtype).removeprefix('torch.')}:{torch.get_num_threads()}t"


def plans_path() -> Path:
    """Where the measured choices live (one section per CPU model and torch version):
    ``$LOOPLM_CPU_GEMM_PLANS`` if set, else ``$XDG_CACHE_HOME/looplm/cpu_gemm_plans.json`` (``~/.cache``)."""
    if os.environ.get("LOOPLM_CPU_GEMM_PLANS"):
        return Path(os.environ["LOOPLM_CPU_GEMM_PLANS"])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "looplm"
    return root / "cpu_gemm_plans.json"


def _section() -> str:
    return f"{cpuinfo.model_name()} | torch {torch.__version__}"


def _load() -> dict[str, str]:
    global _plans
    if _plans is None:
        plans: dict[str, str] = {}
        try:
            data = json.loads(plans_path().read_text())
            plans = {k: v for k, v in data.get(_section(), {}).items() if v in STRATEGIES}
        except (OSError, ValueError, AttributeError):
            pass  # no file yet, or unreadable: measure again
        _plans = plans
    return _plans


def _save(key: str, strategy: str) -> None:
    """Add one choice to the file (read, merge, write to a temporary file and rename: several processes
    of one run may tune at once; the last writer keeps everyone's entries that it read)."""
    path = plans_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data.setdefault(_section(), {})[key] = strategy
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process


def _measure(a: torch.Tensor, b: torch.Tensor) -> str:
    best, best_t = "direct", float("inf")
    for strategy in STRATEGIES:
        _run(a, b, strategy)  # warm: oneDNN builds its kernel for the shape
        t = float("inf")
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            _run(a, b, strategy)
            t = min(t, time.perf_counter() - t0)
        if t < best_t:
            best, best_t = strategy, t
    return best


def plan(a: torch.Tensor, b: torch.Tensor) -> str:
    """The strategy :func:`mm` uses for ``a @ b`` (measured on first use, then remembered)."""
    fast = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device.type, torch.get_num_threads())
    strategy = _fast.get(fast)
    if strategy is None:
        strategy = _fast[fast] = _plan(a, b)
    return strategy


def _plan(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.device.type != "cpu" or a.dtype != torch.bfloat16 or min(a.shape[0], a.shape[1], b.shape[1]) < MIN_SIDE:
        return "direct"
    key = _key(a, b)
    plans = _load()
    strategy = plans.get(key)
    if strategy is None:
        with _lock:
            strategy = plans.get(key)
            if strategy is None:
                strategy = plans[key] = _measure(a, b)
                _save(key, strategy)
    return strategy


def _tuned_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _run(a, b, plan(a, b), bias)


# The op ``looplm::tuned_mm`` (defined with torch.library.Library rather than custom_op: ~10 µs less per
# call, and a training step makes ~600 of them), defined by register(). Its autograd is _LinearsFn's.
_lib: list = []


def _define_tuned_mm() -> None:
    if _lib:
        return
    lib = torch.library.Library("looplm", "FRAGMENT")
    lib.define("tuned_mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor")
    lib.impl("tuned_mm", _tuned_mm, "CompositeExplicitAutograd")  # any device (plain a @ b off CPU bf16)

    @torch.library.register_fake("looplm::tuned_mm", lib=lib)
    def _(a, b, bias=None):
        return a.new_empty(a.shape[0], b.shape[1])

    _lib.append(lib)


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` (2-d CPU tensors of one dtype), in the fastest measured split
    (see the module docstring)."""
    if torch.compiler.is_compiling():
        return torch.ops.looplm.tuned_mm(a, b, bias)  # one node of the compiled graph (defined by register())
    return _tuned_mm(a, b, bias)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` for bf16 CPU operands with an fp32 result, not rounded to bf16 on the way:
    MKL's bf16 GEMM (``looplm_cpu::mm_f32``) where looplm's extension has its AVX-512 build, else
    the operands widened to at least fp32 and multiplied there (a bf16 ``a @ b`` would round its result to
    bf16; a bf16 product is exact in fp32). The weight gradients of bf16 linear layers, for their fp32
    master weights."""
    if a.device.type == "cpu" and a.dtype == b.dtype == torch.bfloat16 and mkl_gemm_ready():
        return torch.ops.looplm_cpu.mm_f32(a, b)
    t = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(t) @ b.to(t)  # [M, K] @ [K, N] -> [M, N] in t


_optimizer_steps = [0]  # optimizer steps taken in this process (part of _weight_copy's cache key)
_step_hook = []


def _count_optimizer_steps() -> None:
    """Register (once) a post-hook on every optimizer's step that counts the steps."""
    if not _step_hook:

        def bump(optimizer, args, kwargs):
            _optimizer_steps[0] += 1

        _step_hook.append(register_optimizer_step_post_hook(bump))


class _LinearsFn(torch.autograd.Function):
    """``[x W₁ᵀ + b₁ | x W₂ᵀ + b₂ | …]`` for one Linear layer (:class:`TunedLinear`) or several reading one
    input (:func:`linear_group`), computed as one product with ``w_c = [W₁; W₂; …]`` (in the compute dtype,
    made by the caller without autograd) through :func:`mm`; the backward is one product for the input
    gradient (``dy [N, Σout] · w_c``: several layers' input gradients summed inside the GEMM, not added
    afterwards) and one :func:`mm_f32` for all weight gradients ``dyᵀ x``, straight into each master
    weight's dtype as a row block of the ``[Σout, in]`` result (the fp32 master weight under autocast: no
    bf16 rounding of the gradient, no cast pass); bias gradients summed in fp32. ``params`` are the master
    weights then the biases (``None`` where a layer has none)."""

    @staticmethod
    def forward(ctx, x, w_c, b_c, *params):
        k = len(params) // 2
        weights, biases = params[:k], params[k:]
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        y = mm(x2, w_c.t(), b_c)  # [N, Σout]
        ctx.save_for_backward(x2, w_c)
        ctx.x_shape, ctx.sizes = x.shape, [w.shape[0] for w in weights]
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.b_dtypes = [None if b is None else b.dtype for b in biases]
        return y.view(*x.shape[:-1], w_c.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, w_c = ctx.saved_tensors
        k = len(ctx.sizes)
        g = grad_y.reshape(-1, grad_y.shape[-1])  # [N, Σout]
        gx = mm(g, w_c).view(ctx.x_shape) if ctx.needs_input_grad[0] else None  # [N, in]
        gws = [None] * k
        if any(ctx.needs_input_grad[3 : 3 + k]):
            blocks = mm_f32(g.t(), x2).split(ctx.sizes)  # [out_i, in] row blocks of one [Σout, in]
            gws = [
                gw.to(dt) if need else None
                for gw, dt, need in zip(blocks, ctx.w_dtypes, ctx.needs_input_grad[3 : 3 + k])
            ]
        gbs = [None] * k
        if any(ctx.needs_input_grad[3 + k :]):
            sums = g.float().sum(0).split(ctx.sizes)  # [out_i]
            gbs = [
                gb.to(dt) if dt is not None and need else None
                for gb, dt, need in zip(sums, ctx.b_dtypes, ctx.needs_input_grad[3 + k :])
            ]
        return gx, None, None, *gws, *gbs


def _weight_copy(linears, dt: torch.dtype, slot: str) -> torch.Tensor:
    """``[W₁; W₂; …]`` (one layer: ``W``) in ``dt``, without autograd (:class:`_LinearsFn` returns the master
    weights' gradients). Like autocast's own cache, outside compiled code the copy is made once per step, not
    at every micro-batch or loop iteration: it is kept in the first layer's ``slot`` with the weights' version
    counters (in-place writes: ``load_state_dict``, foreach optimizers), a count of optimizer steps (fused
    AdamW updates the weights without advancing their version counters, so every ``Optimizer.step`` of the
    process is counted through a global post-hook) and the dtype, and remade when any changes. A compiled
    block casts inside its own graph instead (one fused cast-and-concatenate)."""
    ws = [lin.weight.detach() for lin in linears]
    if torch.compiler.is_compiling():
        return ws[0].to(dt) if len(ws) == 1 else torch.cat([w.to(dt) for w in ws])
    _count_optimizer_steps()
    key = (tuple(lin.weight._version for lin in linears), _optimizer_steps[0], dt)
    cached = linears[0].__dict__.get(slot)
    if cached is not None and cached[0] == key and all(a is b.weight for a, b in zip(cached[2], linears)):
        return cached[1]
    wc = ws[0].to(dt) if len(ws) == 1 else torch.cat([w.to(dt) for w in ws])  # [Σout, in]
    linears[0].__dict__[slot] = (
        key,
        wc,
        tuple(lin.weight for lin in linears),
    )  # not a buffer: outside state_dict and .to()
    return wc


class TunedLinear(nn.Linear):
    """An ``nn.Linear`` whose bf16 products on a CPU go through :func:`mm` and :func:`mm_f32` (same
    parameters, same ``state_dict``); elsewhere it is ``F.linear``.

    Under CPU autocast the input and the weight are cast to the autocast dtype first, as autocast does
    for ``F.linear``; the bf16 copy of the weight is made once per step (:func:`_weight_copy`). The copy
    carries no autograd history (the weight's gradient comes from :class:`_LinearsFn` directly), so one
    copy serves training and inference alike."""

    def _cast_weight(self, dt: torch.dtype) -> torch.Tensor:
        """The weight in ``dt``, without autograd, once per step."""
        return _weight_copy((self,), dt, "_cast_cache")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        w, b = self.weight, self.bias
        w_c, b_c = w.detach(), b.detach() if b is not None else None
        if torch.is_autocast_enabled("cpu"):
            dt = torch.get_autocast_dtype("cpu")
            x = x.to(dt)
            w_c = self._cast_weight(dt) if w.dtype != dt else w_c
            b_c = b_c.to(dt) if b_c is not None else None
        if x.dtype != torch.bfloat16 or w_c.dtype != torch.bfloat16:
            return F.linear(x, w.to(w_c.dtype), b.to(w_c.dtype) if b is not None else None)
        with torch.autocast("cpu", enabled=False):
            return _LinearsFn.apply(x, w_c, b_c, w, b)


def linear_group(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """The ``linear_group`` dispatch op (:mod:`looplm.layers.linear`): ``tuple(lin(x) for lin in linears)``
    for Linear layers that read the same ``x`` (attention's q / k / v projections, SwiGLU's gate and up).
    Where they are all :class:`TunedLinear` and the product is bf16 on a CPU under autograd, it is one
    product with the weights stacked, split into views of one output (the stacked bf16 copy made once per
    step like TunedLinear's); elsewhere the reference (the layers called one by one).

    Why: at the SmolLM2-135M training shape on a 2-core Xeon with AMX the stacked forms took 1.9-2.0 ms
    instead of 2.8-3.1 (q/k/v, 576 + 192 + 192 outputs) and 5.3-5.4 ms instead of 5.9 (gate/up, 2 × 1536)
    for the forward, input-gradient and weight-gradient products of one layer: fewer, larger GEMMs, and the
    input gradients summed inside one GEMM instead of added afterwards."""
    linears = tuple(linears)
    reference = dispatch.OPS["linear_group"].reference
    # training only: without autograd (eval, decoding) the per-layer products need no stacked copy
    if x.device.type != "cpu" or not torch.is_grad_enabled() or not all(type(lin) is TunedLinear for lin in linears):
        return reference(x, linears)
    ws = [lin.weight for lin in linears]
    dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    has_bias = [lin.bias is not None for lin in linears]
    if (
        dt != torch.bfloat16
        or len({w.dtype for w in ws}) != 1
        or len({w.shape[1] for w in ws}) != 1
        or any(has_bias) != all(has_bias)
    ):
        return reference(x, linears)
    if ws[0].dtype != dt and not torch.is_autocast_enabled("cpu"):
        return reference(x, linears)  # fp32 weights outside autocast: F.linear's promotion rules
    w_c = _weight_copy(linears, dt, "_stack_cache")
    b_c = torch.cat([lin.bias.detach().to(dt) for lin in linears]) if all(has_bias) else None
    with torch.autocast("cpu", enabled=False):
        y = _LinearsFn.apply(x.to(dt), w_c, b_c, *ws, *[lin.bias for lin in linears])  # [..., Σout]
    return tuple(y.split([w.shape[0] for w in ws], dim=-1))


def tuned_linears(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`TunedLinear` in place (before compiling);
    returns how many. Parameters, buffers and hooks stay; ``state_dict`` keys are unchanged."""
    _define_tuned_mm()  # compiled TunedLinear products are one looplm::tuned_mm node
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = TunedLinear
            n += 1
    return n


def register() -> None:
    """Serve the ``linear_group`` op with the stacked product above (CPU, bf16, autograd, TunedLinear layers)."""
    _define_tuned_mm()
    dispatch.register("linear_group", linear_group, "looplm.kernels.gemm")


__all__ = [
    "STRATEGIES",
    "TunedLinear",
    "forget",
    "linear_group",
    "mm",
    "mm_f32",
    "plan",
    "plans_path",
    "register",
    "tuned_linears",
]
