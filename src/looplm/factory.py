"""``looplm.build``: a model from a preset name, a YAML path, a dict or a config.

The factory picks the model class for a config — :class:`~looplm.model.LoopedLM`, or
:class:`~looplm.pause.PauseLM` when the config has a ``pause:`` section (pause tokens change the sequence
length, so they wrap the model rather than being a recurrence rule) — and builds it on a device, in a
dtype, or on the ``meta`` device without memory (parameter counts, ``looplm info``).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .config import ModelConfig, load_model_config
from .model import LoopedLM
from .pause import PauseLM

__all__ = [
    "ALLOW_LARGE_ENV",
    "ModelTooLargeError",
    "available_memory",
    "build",
    "build_for_loading",
    "check_fits",
    "model_class",
    "parameter_bytes",
]

ALLOW_LARGE_ENV = "LOOPLM_ALLOW_LARGE"  # =1: build / import models the memory estimate says do not fit


class ModelTooLargeError(ValueError):
    """A model whose parameters alone would not fit in this machine's available memory (the message says both)."""


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
    if device is None or str(device).startswith("cpu"):  # built in fp32 first, whatever ``dtype`` is
        check_fits(parameter_bytes(cfg, torch.float32), f"model {cfg.name!r}")
    with (
        torch.device(device) if device is not None else contextlib.nullcontext(),
        _SkipMetaInit() if meta else contextlib.nullcontext(),
    ):
        model = model_class(cfg)(cfg)
    if device is not None:
        # buffers computed on the CPU on purpose (RoPE's inverse frequencies, in fp64 like HF) join the
        # parameters on ``device``; for every other tensor this is a no-op
        model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model


def parameter_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """The bytes of ``cfg``'s parameters in ``dtype``, estimated from the config alone — embedding, head,
    attention / Mamba-2 mixers and MLPs (norms, gates and adapters are small beside them) — without building
    anything, so that an impossible size (a vocabulary of 10^12) is refused before any allocation."""
    d, V = int(cfg.d_model), int(cfg.vocab_size)
    L = int(cfg.n_physical)
    n_attn = L if cfg.mixer == "attention" else len({i for i in cfg.attn_layer_idx if 0 <= i < L})
    a, m = cfg.attention, cfg.mamba
    H, kv = int(a.n_heads), int(cfg.n_kv_heads) if a.n_heads else 0
    hd = int(a.head_dim or (d // a.n_heads if a.n_heads else 0))
    attn = 2 * d * H * hd + 2 * d * kv * hd
    inner = int(m.expand) * d
    mamba = d * (2 * inner + 2 * int(m.ngroups) * int(m.d_state) + (inner // max(int(m.headdim), 1))) + inner * d
    n = V * d * (1 if cfg.tie_embeddings else 2) + n_attn * attn + (L - n_attn) * mamba + L * 3 * d * int(cfg.d_ff)
    return n * torch.empty(0, dtype=dtype).element_size()


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` of ``/proc/meminfo``, else the free
    physical pages), or ``None`` where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, what: str, *, allow: bool = False, flag: str | None = None) -> None:
    """Refuse (:class:`ModelTooLargeError`) ``nbytes`` of parameters that this machine's available memory cannot
    hold, saying both figures; ``allow`` (or the environment variable ``LOOPLM_ALLOW_LARGE=1``) skips it."""
    if allow or os.environ.get(ALLOW_LARGE_ENV, "") not in ("", "0"):
        return
    avail = available_memory()
    if avail is None or nbytes <= avail:
        return
    gib = 1 << 30
    how = f"{flag} or " if flag else ""
    raise ModelTooLargeError(
        f"{what} needs about {nbytes / gib:,.1f} GiB for its parameters alone, and this machine has "
        f"{avail / gib:,.1f} GiB of memory available: it cannot be built here. Check the config's sizes (vocab_size, "
        f"hidden size, layers); to try anyway, pass {how}set {ALLOW_LARGE_ENV}=1"
    )


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
        [
            nn.init.normal_,
            nn.init.trunc_normal_,
            nn.init.uniform_,
            nn.init.kaiming_uniform_,
            nn.init.kaiming_normal_,
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
        ]
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIP:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)
