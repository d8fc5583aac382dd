"""The dispatch points of looplm's reference code, and the registry that fast paths plug into.

The model (``layers/``, ``blocks.py``, ``recurrence/``, ``model.py``) is plain PyTorch and imports no
fast path. At its few hot points it calls an :class:`Op` instead of the function itself; the op runs
its registered implementation, which is the plain-PyTorch reference until a provider (looplm's own
:mod:`looplm.kernels`, or yours) registers another::

    linear_group   layers/mlp.py, layers/attention.py  q/k/v and gate/up: linears that read one input
    attention      layers/attention.py                 softmax(q kᵀ/√d + mask) v (SDPA)
    loss_chunk     layers/loss.py                      one chunk of the chunked head + cross-entropy
    copy_kv_columns layers/attention.py                per-token exit's copy fill: keys / values between caches

An implementation takes the op's arguments and decides per call whether it applies; where it does not,
it calls ``op.reference`` (so a provider never needs to copy the reference). ``looplm kernels status``
lists every op and who serves it.

A module's **one-token decode step** is the other seam: a provider registers a :class:`DecodeStep` per
module type (a block, a stack of blocks, a rule, a linear layer), with its eligibility test and its
argument packing. Inside :func:`decode_steps` — entered by :func:`looplm.decode.generate.generate` — every
eligible module of the model runs as a subclass of its own class whose methods try the fused step
first and fall back to the class's own method (the reference) whenever the step returns ``None``; on
exit the classes are restored. So a new block or rule gets a fused step by registering one, and no
rule or block is ever edited to become fast. Inside :func:`few_token_steps` (speculative verification) a
step may also serve calls of a few positions per sequence; a step that does not read
:func:`few_token_calls` is unaffected. Inside :func:`offer_kv_fill` (per-token exit's ``propagate`` fill
carried into the next core pass, :mod:`looplm.decode.kv_fill`) the fused step of that fill's stack may write it
with its own K/V products; the decoder writes it itself after the call where no step took it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "OPS",
    "DECODE_STEPS",
    "DecodeStep",
    "Op",
    "decode_steps",
    "describe",
    "few_token_calls",
    "few_token_steps",
    "offer_kv_fill",
    "offered_kv_fill",
    "plain_class",
    "register",
    "register_decode_step",
    "reference_only",
    "unregister",
]

OPS: dict[str, "Op"] = {}
_pending: dict[str, tuple[Callable, str]] = {}  # registrations for ops whose module is not imported yet


class Op:
    """One hot point of the reference code: a name, the plain-PyTorch ``reference``, and the
    implementation calls take (``impl``, the reference until a provider registers one)."""

    __slots__ = ("name", "reference", "impl", "provider", "_registered", "doc")

    def __init__(self, name: str, reference: Callable, doc: str = ""):
        if name in OPS:
            raise ValueError(f"dispatch op {name!r} is defined twice")
        self.name, self.reference, self.doc = name, reference, doc
        self.impl, self.provider = reference, "reference"
        self._registered: tuple[Callable, str] | None = None
        OPS[name] = self
        if name in _pending:  # a provider registered before the op's module was imported
            register(name, *_pending.pop(name))

    def __call__(self, *args, **kwargs):
        return self.impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name!r}, provider={self.provider!r})"


_suspended = 0  # reference_only() depth


def register(name: str, impl: Callable, provider: str) -> None:
    """Serve op ``name`` with ``impl`` (same arguments as the reference; it calls ``OPS[name].reference``
    where it does not apply). ``provider`` names who registered it (``looplm kernels status``). An op whose
    module is not imported yet takes the registration when it is defined."""
    op = OPS.get(name)
    if op is None:
        _pending[name] = (impl, provider)
        return
    op._registered = (impl, provider)
    if not _suspended:
        op.impl, op.provider = impl, provider


def unregister(name: str) -> None:
    """Back to the reference for op ``name``."""
    _pending.pop(name, None)
    op = OPS.get(name)
    if op is not None:
        op._registered = None
        op.impl, op.provider = op.reference, "reference"


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Inside the block every op runs its reference and :func:`decode_steps` switches nothing (tests of
    the reference path, comparisons in one process); registrations made inside take effect on exit."""
    global _suspended
    _suspended += 1
    for op in OPS.values():
        op.impl, op.provider = op.reference, "reference"
    try:
        yield
    finally:
        _suspended -= 1
        if not _suspended:
            for op in OPS.values():
                if op._registered is not None:
                    op.impl, op.provider = op._registered


# ------------------------------------------------------------------------------------------------
# fused one-token decode steps, per module type
# ------------------------------------------------------------------------------------------------


@dataclass
class DecodeStep:
    """A fused one-token step for modules of exactly ``module_type``.

    * ``prepare(module, batch_size)`` — the step's arguments, packed once per :func:`decode_steps`
      (weights, epsilons, shapes); ``None`` when the module is not eligible (wrong dtype or device, hooks,
      a variant the step does not cover, a batch size it does not win at).
    * ``methods`` — method name -> ``fn(module, prepared, *args, **kwargs)`` returning the method's result,
      or ``None`` to run the class's own method (the reference) for this call.

    Every eligible module is prepared before any class is switched, so a ``prepare`` may read other
    modules' plain classes (a stack's step reads its blocks').
    """

    name: str
    module_type: type
    prepare: Callable[[nn.Module, int | None], Any]
    methods: dict[str, Callable[..., Any]]
    provider: str = ""
    _classes: dict = field(default_factory=dict, repr=False)

    def fused_class(self) -> type:
        """``module_type``'s subclass whose methods try the fused step first (made once)."""
        cls = self._classes.get("cls")
        if cls is None:
            base = self.module_type
            ns = {
                "__doc__": f"{base.__name__} with its one-token decode step fused ({self.name}); see looplm.dispatch",
                "_looplm_plain_class": base,
            }
            for meth, fn in self.methods.items():
                ns[meth] = _try_fused(meth, fn, getattr(base, meth))
            cls = self._classes["cls"] = type(f"Fused{base.__name__}", (base,), ns)
        return cls


def _try_fused(meth: str, fn: Callable, reference: Callable) -> Callable:
    def method(self, *args, **kwargs):
        y = fn(self, self.__dict__["_looplm_decode"], *args, **kwargs)
        return y if y is not None else reference(self, *args, **kwargs)

    method.__name__ = meth
    return method


DECODE_STEPS: dict[type, DecodeStep] = {}


def register_decode_step(step: DecodeStep) -> None:
    """Register ``step`` for ``step.module_type`` (one step per type; a later registration replaces it)."""
    DECODE_STEPS[step.module_type] = step


def plain_class(module: nn.Module) -> type:
    """``module``'s own class, also while :func:`decode_steps` has switched it to a fused subclass."""
    return getattr(type(module), "_looplm_plain_class", type(module))


@contextlib.contextmanager
def decode_steps(
    model: nn.Module, batch_size: int | None = None, only: Callable[[DecodeStep], bool] | None = None
) -> Iterator[dict[str, int]]:
    """Inside the block, every module of ``model`` with a registered :class:`DecodeStep` whose
    ``prepare`` accepts it runs the fused step (its class swapped for the step's subclass; parameters,
    buffers and state dict unchanged); the classes are restored on exit. ``only`` restricts the steps
    (benchmarks, tests). Yields how many modules each step switched. A no-op under :func:`reference_only`."""
    chosen: list[tuple[nn.Module, DecodeStep, Any]] = []
    if not _suspended and DECODE_STEPS:
        for m in model.modules():
            step = DECODE_STEPS.get(type(m))
            if step is not None and (only is None or only(step)):
                prepared = step.prepare(m, batch_size)
                if prepared is not None:
                    chosen.append((m, step, prepared))
    counts: dict[str, int] = {}
    for m, step, prepared in chosen:  # all prepared first: a step may read other modules' plain classes
        m.__dict__["_looplm_decode"] = prepared
        m.__class__ = step.fused_class()
        counts[step.name] = counts.get(step.name, 0) + 1
    try:
        yield counts
    finally:
        for m, step, _ in chosen:
            m.__class__ = step.module_type
            m.__dict__.pop("_looplm_decode", None)


_few_tokens = [False]


@contextlib.contextmanager
def few_token_steps() -> Iterator[None]:
    """Inside the block (and inside :func:`decode_steps`), a decode step may also take calls of a few
    positions per sequence, not only one: a speculative verification's ``k + 1`` drafted tokens
    (:mod:`looplm.decode.speculative`), where a step that wins at a few rows (a GEMV kernel) beats the
    reference's matmul. A step reads :func:`few_token_calls`; one that ignores it is unaffected."""
    prev, _few_tokens[0] = _few_tokens[0], True
    try:
        yield
    finally:
        _few_tokens[0] = prev


def few_token_calls() -> bool:
    """Whether :func:`few_token_steps` is active (read by decode steps at each call)."""
    return _few_tokens[0]


_kv_fill: list = [None]


@contextlib.contextmanager
def offer_kv_fill(fill) -> Iterator[None]:
    """Inside the block, a decode step of ``fill.stack`` may write ``fill`` (a :class:`looplm.decode.kv_fill.KVFill`)
    beside its own step and set ``fill.written``; the caller writes it (``fill.write()``) where none did.
    ``None`` offers nothing."""
    prev, _kv_fill[0] = _kv_fill[0], fill
    try:
        yield
    finally:
        _kv_fill[0] = prev


def offered_kv_fill(module: nn.Module):
    """The fill :func:`offer_kv_fill` offers to ``module`` (its ``stack``), not written yet, or ``None``."""
    f = _kv_fill[0]
    return f if f is not None and not f.written and f.stack is module else None


def describe() -> list[tuple[str, str]]:
    """``(what, provider)`` for every op and every registered decode step (``looplm kernels status``)."""
    rows = [(f"op {op.name}", op.provider) for op in OPS.values()]
    rows += [(f"op {name} (its module not imported yet)", provider) for name, (_, provider) in _pending.items()]
    rows += [(f"decode step {s.name} ({s.module_type.__name__})", s.provider or "?") for s in DECODE_STEPS.values()]
    return rows
