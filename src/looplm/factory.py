"""``looplm.build``: a model from a preset name, a YAML path, a dict or a config.

The factory picks the model class for a config — :class:`~looplm.model.LoopedLM`, or
:class:`~looplm.pause.PauseLM` when the config has a ``pause:`` section (pause tokens change the sequence
length, so they wrap the model rather than being a recurrence rule) — and builds it on a device, in a
dtype, or on the ``meta`` device without memory (parameter counts, ``looplm info``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .config import ModelConfig, load_model_config
from .model import LoopedLM
from .pause import PauseLM

__all__ = ["build", "build_for_loading", "model_class"]


def model_class(cfg: ModelConfig) -> type[LoopedLM]:
    """The class that implements ``cfg``: :class:`PauseLM` for a ``pause:`` config, else :class:`LoopedLM`."""
    return PauseLM if cfg.pause is not None else LoopedLM


def build(spec="tiny-llama", *, device=None, dtype=None, overrides=None, **kw) -> LoopedLM:
    """Build a model from a preset name, a YAML path, a dict or a :class:`ModelConfig`.

    Extra keyword arguments are config overrides (``n_loops=4``); dotted overrides go in
    ``overrides={"attention.n_heads": 2}``. ``device="meta"`` builds without memory (parameter counts).
    """
    if isinstance(overrides, (list, tuple)):
        from .dataclass_util import parse_value, split_override

        overrides = {k: parse_value(v) for k, v in map(split_override, overrides)}
    ov = dict(overrides or {})
    ov.update(kw)
    cfg = load_model_config(spec, ov or None)
    meta = str(device) == "meta"
    with torch.device(device) if device is not None else contextlib.nullcontext(), _SkipMetaInit() if meta else contextlib.nullcontext():
        model = model_class(cfg)(cfg)
    if device is not None:
        # buffers computed on the CPU on purpose (RoPE's inverse frequencies, in fp64 like HF) join the
        # parameters on ``device``; for every other tensor this is a no-op
        model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model


def build_for_loading(cfg: ModelConfig) -> LoopedLM:
    """``cfg``'s model with every parameter and persistent buffer on the ``meta`` device — no memory, no
    random initialisation — for ``load_state_dict(sd, assign=True)`` (see
    :func:`looplm.checkpoint_io.load_model_weights`). Buffers computed at construction (RoPE's inverse
    frequencies, computed on the CPU on purpose) are real already: the weights are all that is missing.
    Initialising a SmolLM2-135M-shaped model and copying the weights over it cost ~3.5 s of ``looplm
    generate``'s start-up; this costs ~25 ms."""
    with torch.device("meta"), _SkipMetaInit():
        return model_class(cfg)(cfg)


class _SkipMetaInit(TorchFunctionMode):
    """Make torch's random initialisers no-ops on meta tensors, for this ``with`` block only.

    A meta tensor has no values to initialise, yet ``normal_`` on the meta device dispatches through
    torch's Python reference kernels, which import dynamo (about 2 s) — most of ``looplm info``'s time.
    """

    _SKIP = frozenset(
        [nn.init.normal_, nn.init.trunc_normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
         torch.Tensor.normal_, torch.Tensor.uniform_]
    )  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIP:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)
