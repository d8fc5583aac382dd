"""What the driver hands to the blocks and the recurrence rules each forward (leaf types, plain data).

* :class:`ForwardContext` (``fctx``): positions, rotary tables and masks, shared by every block;
* :class:`BranchModulation` / :class:`BlockModulation`: the hooks a rule may put inside a block's
  residual branches (timestep conditioning, hyper-connections; see :mod:`looplm.blocks`);
* :class:`LoopContext` (``lctx``): where the loop driver is and what a rule may read
  (see :mod:`looplm.recurrence.base`);
* :func:`restrict_fctx` / :func:`restrict_context`: both as some batch rows see them (per-token exit's rows
  or tokens still looping: :mod:`looplm.decode.token_schedule`, :mod:`looplm.decode.exit_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .cache import LoopCache

__all__ = ["BlockModulation", "BranchModulation", "ForwardContext", "LoopContext", "restrict_context", "restrict_fctx"]


@dataclass
class ForwardContext:
    """Per-forward information shared by every block (built once per forward by the model): ``fctx``."""

    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # rotary dim -> cos, sin [B, T, rot]
    positions: torch.Tensor | None = None  # [B, T] position of each token (left padding counts real tokens only)
    attn_mask: torch.Tensor | None = None  # bool [B, 1, T, T_past+T]; None = plain causal
    is_causal: bool = True
    pad_mask: torch.Tensor | None = None  # bool [B, T], True = real token (left padding)

    def rope_for(self, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` tables ``[B, T, rotary_dim]``; the model builds one per rotary dim it declares."""
        try:
            return self.rope[rotary_dim]
        except KeyError:
            raise KeyError(
                f"no rotary tables for rotary dim {rotary_dim} (have {sorted(self.rope)}); a recurrence rule that "
                "owns an attention mixer must declare its head dim in `rope_dims`"
            ) from None


@dataclass
class BranchModulation:
    """Hooks of one residual branch. Tensors are ``None`` (identity) or broadcastable to ``[B, T, d]``
    (per channel ``[d]``, per sequence ``[B, 1, d]`` or per token ``[B, T, d]``)."""

    scale: torch.Tensor | None = None  # multiplies the normalised branch input
    shift: torch.Tensor | None = None  # added to the normalised branch input (after the scale)
    gate: torch.Tensor | None = None  # multiplies the branch output
    read: Callable[[torch.Tensor], torch.Tensor] | None = None  # residual carrier -> branch input [B, T, d]
    write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (carrier, branch out) -> carrier


@dataclass
class BlockModulation:
    """The modulation of one block call: one :class:`BranchModulation` per branch (``None`` = plain)."""

    mixer: BranchModulation | None = None
    mlp: BranchModulation | None = None


@dataclass
class LoopContext:
    """Where the driver is and what a rule may read (see :mod:`looplm.recurrence.base`). Called ``lctx``."""

    iteration: int = 0  # k
    num_loops: int = 1  # r: iterations the driver runs (the largest per-row count)
    train_loops: int = 1  # K: the config's training loop count
    loops_per_row: torch.Tensor | None = None  # [B] long, when depth was given per sequence
    fctx: ForwardContext | None = None  # the blocks' context (positions, rotary tables, masks)
    cache: LoopCache | None = None  # the decoding cache, None outside decoding
    loop_options: dict[str, Any] = field(default_factory=dict)  # rule-specific inference options
    embeddings: torch.Tensor | None = None  # E [B, T, d], before the prelude
    embed_weight: torch.Tensor | None = None  # [V, d] token embedding matrix (unscaled)
    embed_multiplier: float = 1.0  # E = embed_multiplier · embed_weight[x]
    targets: torch.Tensor | None = None  # [B, T] next-token targets (-100 = ignore), training only
    core_input: torch.Tensor | None = None  # Z^k, set by the driver before rule.step
    readout_fn: Callable[[torch.Tensor, "LoopContext"], torch.Tensor] | None = None
    # the model's final RMSNorm N (the module itself, shared weights): rules that normalise the state between
    # iterations (Ouro), feed their exit gate a normed state or normalise the loop's output (Huginn) use it
    final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    # the exit check's readout of an iterate, (h [n, T, d], lctx) -> logits [n, T, V]; None = the model's own
    # (coda with the check's per-loop slots, final norm, head). A driver that packs tokens differently from the
    # rows it hands the rule gives its own (looplm.decode.exit_forward: the coda over each row's looping tokens)
    check_readout: Callable[[torch.Tensor, "LoopContext"], torch.Tensor] | None = None

    @property
    def positions(self) -> torch.Tensor:
        """``[B, T]`` token positions."""
        return self.fctx.positions

    @property
    def is_last(self) -> bool:
        """Whether this is the last iteration the driver runs."""
        return self.iteration == self.num_loops - 1

    def rope_for(self, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary ``(cos, sin)`` tables ``[B, T, rotary_dim]`` (the dim must be declared in ``rope_dims``)."""
        return self.fctx.rope_for(rotary_dim)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of any iterate ``h [B, T, d]``: coda, final norm and head. During decoding
        the coda uses slots of its own per iteration (``("readout", k, layer)``)."""
        return self.readout_fn(h, self)

    def active_rows(self) -> torch.Tensor | None:
        """``[B]`` bool: rows still looping at this iteration (``None`` = every row)."""
        if self.loops_per_row is None:
            return None
        return self.iteration < self.loops_per_row

    def cache_slot(self, key, factory: Callable[[], Any]):
        """A decoding cache slot owned by the rule (``None`` when not decoding); see :mod:`looplm.cache`."""
        if self.cache is None:
            return None
        return self.cache.slot(("rule", key), factory)

    def loop_slot(self, name: str, factory: Callable[[], Any]):
        """The rule's slot ``name`` of this iteration, ``("rule", name, k)`` (``None`` when not decoding):
        one slot per iteration, registered as loop ``k`` of the family ``("rule", name)`` so that per-token
        exit fills the loops a token skipped (:mod:`looplm.decode.token_schedule`). ``factory`` makes a slot for
        ``cache.batch_size`` rows."""
        if self.cache is None:
            return None
        k = self.iteration
        return self.cache.slot(("rule", name, k), factory, loop=k, family=("rule", name))


# --- row subsets (per-token exit: the rows or tokens still looping) ----------------------------------
def restrict_fctx(fctx: ForwardContext, idx: torch.Tensor) -> ForwardContext:
    """``fctx`` for batch rows ``idx`` (rotary tables, positions, masks)."""
    pick = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
    return ForwardContext(
        rope={r: (cos.index_select(0, idx), sin.index_select(0, idx)) for r, (cos, sin) in fctx.rope.items()},
        positions=pick(fctx.positions),
        attn_mask=pick(fctx.attn_mask),
        is_causal=fctx.is_causal,
        pad_mask=pick(fctx.pad_mask),
    )


def restrict_context(lctx: LoopContext, idx: torch.Tensor) -> LoopContext:
    """``lctx`` as batch rows ``idx`` see it: their forward context, embeddings, and row views of the cache."""
    pick = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
    return replace(
        lctx,
        fctx=restrict_fctx(lctx.fctx, idx),
        cache=None if lctx.cache is None else lctx.cache.rows(idx),
        embeddings=pick(lctx.embeddings),
        loops_per_row=pick(lctx.loops_per_row),
        targets=pick(lctx.targets),
        core_input=None,
    )
