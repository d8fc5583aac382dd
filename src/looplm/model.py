"""LoopedLM: ``embed → prelude (p) → [core (s) ∘ rule] × r → coda (c) → norm → head``.

The driver below is the whole looped computation. It calls the recurrence rule between iterations
(see :mod:`looplm.recurrence.base`) and never branches on which rule it holds. Parallelism,
activation checkpointing (per loop iteration: wrap ``model.core``), ``torch.compile`` and fast kernels
are applied from outside (:mod:`looplm.parallel`, :mod:`looplm.dispatch`). Models are made by
:func:`looplm.build` (:mod:`looplm.factory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import Stack
from .cache import LoopCache
from .config import ModelConfig
from .context import ForwardContext, LoopContext
from .layers.loss import linear_cross_entropy
from .layers.rope import RotaryEmbedding
from .recurrence import build_rule


@dataclass
class LoopedLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # training loss when labels are given: lm_loss_weight·CE + aux_loss
    aux_loss: torch.Tensor | None = None  # the rule's auxiliary loss on its own (None when it has none)
    lm_loss: torch.Tensor | None = None  # the plain next-token cross-entropy of the final logits (for perplexity)
    iterations: list[torch.Tensor] | None = None  # H^k for k < r, each [B, T, d], when asked
    hidden: torch.Tensor | None = None  # final hidden state before the head (after the final norm)
    cache: LoopCache | None = None
    executed_loops: int | None = None  # iterations the driver ran (fewer than r when every token halted)


class LoopCore(nn.Module):
    """The shared core: ``s`` blocks run once per loop iteration (the unit of per-loop checkpointing)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.stack = Stack(cfg, cfg.n_prelude, cfg.n_core)

    def forward(self, z: torch.Tensor, fctx: ForwardContext, caches=None, mods=None) -> torch.Tensor:
        return self.stack(z, fctx, caches, mods)


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.prelude = Stack(cfg, 0, cfg.n_prelude)
        self.core = LoopCore(cfg)
        self.coda = Stack(cfg, cfg.n_prelude + cfg.n_core, cfg.n_coda)
        self.rule = build_rule(cfg)
        self.norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.embed.weight._no_muon = True
        self.lm_head.weight._no_muon = True
        self.embed_multiplier = math.sqrt(d) if cfg.embed_scale else 1.0
        # one table builder per rotary dim: the backbone's attention (config) and the rule's own mixers
        a = cfg.attention
        dims = sorted(set(cfg.rope_dims) | set(self.rule.rope_dims))
        self.rotary = nn.ModuleDict(
            {str(r): RotaryEmbedding(r, a.rope_theta, a.rope_scaling, a.rope_precision) for r in dims}
        )
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Initialise: N(0, std) for Linear/Embedding weights, zeros for biases, then each module's own
        ``looplm_init()`` (rules' zero/identity inits, Mamba-2's A/dt/D) so papers' init claims hold."""
        if self.embed.weight.is_meta:  # nothing to initialise (parameter counting); keeps `looplm info` fast
            return
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
        for m in self.modules():
            if m is not self and hasattr(m, "looplm_init"):
                m.looplm_init()
        for rot in self.rotary.values():
            rot.reset_buffers()

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (shared core counted once; a tied head counted once)."""
        seen, n = set(), 0
        for p in self.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n += p.numel()
        if exclude_embeddings:
            n -= self.embed.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def new_cache(
        self, batch_size: int, num_loops: int | None = None, capacity: int | None = None, kv_shared: bool = False
    ) -> LoopCache:
        """An empty decoding cache for ``num_loops`` iterations; ``capacity`` tokens preallocates KV slots;
        ``kv_shared``: one KV buffer per layer for every loop (the ``shared`` exit policy)."""
        p = next(self.parameters())
        cache = LoopCache(
            num_loops or self.config.n_loops,
            batch_size,
            device=p.device,
            dtype=p.dtype,
            capacity=capacity,
            kv_shared=kv_shared,
        )
        cache.model_signature = self._cache_signature()
        return cache

    def _cache_signature(self) -> dict:
        """What a decoding cache's slots depend on (widths, layers, mixers, rule): another model's cache
        does not fit when any of these differ."""
        c = self.config
        return {
            "d_model": c.d_model,
            "layers (p, s, c)": (c.n_prelude, c.n_core, c.n_coda),
            "mixers": tuple(c.mixer_of(i) for i in range(c.n_physical)),
            "attention (kv heads, head dim)": (c.attention.n_kv_heads, c.attention.head_dim),
            "rule": (c.rule.name, repr(sorted(c.rule.options.items()))),
        }

    # ------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------ the public step API
    # The pieces ``forward`` is made of, for drivers that run the loop their own way (looplm.decode's token /
    # depth / static schedules, the one-forward exit, looplm.serve's runner, the vLLM plugin): they call these
    # and never a private method, so the arithmetic of a step lives here once.
    #
    #   check_inputs(ids, cache, mask)          refuse bad ids / shapes / another model's cache (host sync)
    #   forward_context(ids, mask, pos, past)   rope, positions and the attention mask of a call -> ForwardContext
    #   embed_tokens(ids)                       E = embed(ids) · embed_multiplier           [B, T, d]
    #   cache_slots(cache, stack, key, B, ...)  the decoding slots of a stack's blocks (None without a cache)
    #   loop_iteration(state, lctx, B)          Z^k = rule.next_input, H^k = core(Z^k), rule.step -> (H^k, state)
    #   readout(h, lctx)                        logits of an intermediate iterate: coda -> norm -> head
    def check_inputs(self, input_ids: torch.Tensor, cache: LoopCache | None = None, attention_mask=None) -> None:
        """Refuse what ``forward`` cannot run, naming the value: ids that are no ``[B, T]`` integer tensor, a
        length past ``max_seq_len``, a mask of the wrong shape, another model's cache, ids outside the vocabulary
        (the last one reads the ids on the host)."""
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq_len], got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        B, T = input_ids.shape
        if B == 0 or T == 0:
            raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); pass at least one token")
        past = cache.seqlen if cache is not None else 0
        if past + T > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {past + T} exceeds the model's max_seq_len={cfg.max_seq_len}; "
                "truncate the input or build the model with a larger max_seq_len"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(
                f"attention_mask must have shape [batch, past + seq_len] = {(B, past + T)}, got {tuple(attention_mask.shape)}"
            )
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"cache holds batch size {cache.batch_size}, input has {B}")
        if cache is not None:
            mine = self._cache_signature()
            theirs = getattr(cache, "model_signature", None)
            if theirs is None:
                cache.model_signature = mine
            elif theirs != mine:
                diff = "; ".join(f"{k} {theirs.get(k)} vs {v}" for k, v in mine.items() if theirs.get(k) != v)
                raise ValueError(
                    f"this cache belongs to another model ({diff}, cache vs this model); "
                    "make one for this model with model.new_cache(batch_size)"
                )
        if torch.compiler.is_compiling():
            return
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size}); check that the tokenizer matches the model"
            )

    def _resolve_loops(self, num_loops, cache: LoopCache | None, batch: int) -> tuple[int, torch.Tensor | None]:
        """``num_loops`` (None, an int, or a ``[B]`` integer tensor of per-sequence counts) -> (r, per-row)."""
        if num_loops is None:
            r = cache.num_loops if cache is not None else self.config.n_loops
            return r, None
        if isinstance(num_loops, torch.Tensor) and num_loops.dim() == 1:
            if num_loops.dtype.is_floating_point or num_loops.dtype == torch.bool or num_loops.shape[0] != batch:
                raise ValueError(
                    f"per-sequence num_loops must be an integer tensor of shape [batch] = [{batch}], "
                    f"got dtype {num_loops.dtype} and shape {tuple(num_loops.shape)}"
                )
            r = int(num_loops.max())
            if int(num_loops.min()) < 1:
                raise ValueError(f"every per-sequence loop count must be >= 1, got {num_loops.tolist()}")
            return r, num_loops.to(self.embed.weight.device, torch.long)
        if isinstance(num_loops, torch.Tensor) and num_loops.dim() == 0 and not num_loops.dtype.is_floating_point:
            num_loops = int(num_loops)
        if isinstance(num_loops, bool) or not isinstance(num_loops, int):
            raise TypeError(
                f"num_loops must be a positive int or a [batch] integer tensor, got {num_loops!r} ({type(num_loops).__name__})"
            )
        if num_loops < 1:
            raise ValueError(f"num_loops must be >= 1, got {num_loops}")
        return num_loops, None

    def forward_context(self, input_ids, attention_mask=None, position_ids=None, past: int = 0) -> ForwardContext:
        """The per-call context every block reads: rotary ``cos, sin [B, T, rot]`` at the tokens' positions (left
        padding counts real tokens only), the attention mask (``None``: causal / everything before), the pad mask."""
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                # left padding: positions count real tokens only, so a padded row matches the row alone
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=dev).unsqueeze(0).expand(B, T)
        rope = {int(r): rot(position_ids) for r, rot in self.rotary.items()}  # rotary dim -> cos, sin [B, T, r]
        attn_mask, is_causal, pad_mask = None, past == 0, None
        if attention_mask is not None or (past > 0 and T > 1):
            q_pos = torch.arange(past, past + T, device=dev)[:, None]
            k_pos = torch.arange(past + T, device=dev)[None, :]
            allowed = (k_pos <= q_pos)[None, None]  # [1, 1, T, past+T]
            if attention_mask is not None:
                keep = attention_mask.bool()
                allowed = allowed & keep[:, None, None, :]
                # a padding query row attends to itself only: finite garbage, never NaN (it is masked as a key)
                allowed = allowed | (k_pos == q_pos)[None, None]
                pad_mask = keep[:, -T:]
            attn_mask = allowed
            is_causal = False
        elif past > 0:  # one new token attends to everything before it
            is_causal = False
        return ForwardContext(
            rope=rope, positions=position_ids, attn_mask=attn_mask, is_causal=is_causal, pad_mask=pad_mask
        )

    def cache_slots(
        self, cache: LoopCache | None, stack: Stack, key, batch: int, loop: int | None = None, family=None
    ) -> list | None:
        """Decoding slots of ``stack``'s blocks under ``(*key, layer)`` (``None`` without a cache); slots of
        loop iteration ``loop`` belong to ``(family, layer)`` (see :mod:`looplm.cache`)."""
        if cache is None:
            return None
        n = cache.batch_size  # a slot holds the whole batch (a loop over some rows views it)
        return [
            cache.slot(
                (*key, blk.layer_idx),
                lambda blk=blk: blk.new_cache(n, capacity=cache.capacity),
                loop,
                None if loop is None else (family, blk.layer_idx),
            )
            for blk in stack.blocks
        ]

    def _embed(self, input_ids: torch.Tensor, head_in_loss: bool) -> torch.Tensor:
        """``embed(input_ids)`` ``[B, T, d]``. When the embedding is tied to the head and the head's dense
        gradient comes in the same backward (a loss on CPU), the lookup's own gradient is a sparse ``[V, d]``
        tensor (the batch's rows only), which autograd adds into the head's in place, instead of a
        zero-filled dense ``[V, d]`` gradient added as a whole: 14.7 ms of the SmolLM2-135M-shape step on a
        2-core Xeon (49,152 × 576 rows, 1,024 tokens) become ~1 ms. The sum is the same dense gradient."""
        w = self.embed.weight
        sparse = (
            head_in_loss
            and self.config.tie_embeddings
            and torch.is_grad_enabled()
            and w.requires_grad
            and w.device.type == "cpu"
            and type(w.data) is torch.Tensor  # not a DTensor shard (FSDP2)
        )
        if not sparse:
            return self.embed(input_ids)
        return F.embedding(input_ids, w, sparse=True)

    def embed_tokens(self, input_ids: torch.Tensor, head_in_loss: bool = False) -> torch.Tensor:
        """``E = embed(input_ids) · embed_multiplier`` ``[B, T, d]``: the prelude's input and the rule's ``e``
        (``head_in_loss``: the training path's sparse lookup gradient, :meth:`_embed`)."""
        return self._embed(input_ids, head_in_loss) * self.embed_multiplier

    def readout(self, h: torch.Tensor, lctx: LoopContext, family: str = "readout") -> torch.Tensor:
        """Logits of an intermediate iterate (``lctx.readout``): coda -> final norm -> head. During decoding
        the coda has slots of its own per iteration, ``(family, k, layer)``."""
        k = lctx.iteration
        y = self.coda(
            h, lctx.fctx, self.cache_slots(lctx.cache, self.coda, (family, k), h.shape[0], loop=k, family=family)
        )
        return self.lm_head(self.norm(y))

    def loop_iteration(self, state, lctx: LoopContext, batch: int):
        """Loop iteration ``k = lctx.iteration`` of ``batch`` rows: the core's input ``Z^k`` from the rule
        (kept as ``lctx.core_input``), ``H^k = core(Z^k)`` with the rule's block modulation and the cache
        slots of loop ``k``, then the rule's step. Returns ``(H^k, state)``. One place for the body of every
        loop driver (this forward, :mod:`looplm.decode.token_schedule`'s exits, drafts and verifications)."""
        k = lctx.iteration
        z = lctx.core_input = self.rule.next_input(state, lctx)  # Z^k  [batch, T, d]
        mods = self.rule.block_modulation(state, lctx)
        slots = self.cache_slots(lctx.cache, self.core.stack, (k,), batch, loop=k, family="core")
        h = self.core(z, lctx.fctx, slots, mods)  # H^k
        return h, self.rule.step(state, h, lctx)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LoopCache | None = None,
        num_loops: int | torch.Tensor | None = None,
        num_grad_loops: int | None = None,
        output_iterations: bool = False,
        output_hidden: bool = False,
        loop_options: dict | None = None,
        return_logits: bool = True,
        logits_to_keep: int | None = None,
        validate: bool = True,
    ) -> LoopedLMOutput:
        """Run the looped model.

        Args:
            input_ids: ``[B, T]`` token ids (new tokens only when ``cache`` holds a prefix).
            labels: ``[B, T]`` targets aligned with ``input_ids`` (shifted inside; ``-100`` ignored).
            attention_mask: ``[B, T_past + T]``, 1 = real token, 0 = left padding.
            cache: decoding cache (see :mod:`looplm.cache`); filled in place.
            num_loops: ``r``, loops to run (default: the training count ``K``); an int, or a ``[B]``
                integer tensor of per-sequence counts (finished rows pass through unchanged).
            num_grad_loops: truncated backprop: only the last ``m`` iterations record gradients.
            output_iterations: also return every iteration's core output ``H^k`` (free when off).
            loop_options: rule-specific inference options (``lctx.loop_options``).
            return_logits: ``False`` with ``labels``: the loss is computed chunk by chunk from the final
                hidden state (:func:`~looplm.layers.loss.linear_cross_entropy`) and the ``[B, T, V]``
                logits are never materialised (``output.logits`` is ``None``). The trainer's path.
            logits_to_keep: apply the head to the last ``n`` positions only (decoding: ``1``).
            validate: check token ids against the vocabulary (a host sync); ``generate`` checks the
                prompt once and skips it for the tokens it sampled itself.
        """
        if validate:
            self.check_inputs(input_ids, cache, attention_mask)
        if logits_to_keep is not None and labels is not None:
            raise ValueError("logits_to_keep is for decoding; the loss needs the logits of every position")
        B = input_ids.shape[0]
        r, loops_per_row = self._resolve_loops(num_loops, cache, B)
        if num_grad_loops is not None and (
            isinstance(num_grad_loops, bool) or not isinstance(num_grad_loops, int) or num_grad_loops < 1
        ):
            raise ValueError(
                f"num_grad_loops must be None (backprop through every loop) or an int >= 1, got {num_grad_loops!r}"
            )
        if loop_options:
            self.rule.check_loop_options(loop_options)
        if cache is not None and cache.num_loops != r:
            raise ValueError(f"cache was built for {cache.num_loops} loops, forward asked for {r}")
        fctx = self.forward_context(input_ids, attention_mask, position_ids, cache.seqlen if cache is not None else 0)
        targets = (
            None if labels is None else F.pad(labels[:, 1:], (0, 1), value=-100)
        )  # [B, T]; shift targets, not logits

        E = self.embed_tokens(input_ids, head_in_loss=labels is not None)  # [B, T, d]
        x = self.prelude(E, fctx, self.cache_slots(cache, self.prelude, (0,), B))
        lctx = LoopContext(
            num_loops=r,
            train_loops=self.config.n_loops,
            loops_per_row=loops_per_row,
            fctx=fctx,
            cache=cache,
            loop_options=loop_options or {},
            embeddings=E,
            embed_weight=self.embed.weight,
            embed_multiplier=self.embed_multiplier,
            targets=targets,
            readout_fn=self.readout,
            final_norm=self.norm,
        )
        no_grad_until = r - num_grad_loops if num_grad_loops is not None and self.training else 0
        iterations = [] if output_iterations else None

        state = self.rule.begin(x, lctx)
        for k in range(r):
            lctx.iteration = k
            with torch.set_grad_enabled(torch.is_grad_enabled() and k >= no_grad_until):
                h, new_state = self.loop_iteration(state, lctx, B)  # H^k [B, T, d], the rule's state after it
                active = lctx.active_rows()  # [B] or None: rows whose own loop count is not reached yet
                state = new_state if active is None else self.rule.select_rows(active, new_state, state)
            if iterations is not None:
                iterations.append(
                    h if active is None or k == 0 else torch.where(active[:, None, None], h, iterations[-1])
                )
            if cache is None and k < r - 1 and self._all_halted(state, lctx):
                break
        y = self.rule.finish(state, lctx)  # [B, T, d]
        y = self.coda(y, fctx, self.cache_slots(cache, self.coda, (0,), B))
        hidden = self.norm(y)
        if cache is not None:
            cache.commit(input_ids.shape[1])
        fused_loss = labels is not None and not return_logits
        head_in = hidden if logits_to_keep is None else hidden[:, -logits_to_keep:]
        logits = None if fused_loss else self.lm_head(head_in)  # [B, T, V]

        loss = aux = lm = None
        if labels is not None:
            aux = self.rule.aux_loss(state, lctx)
            if fused_loss:
                lm = linear_cross_entropy(hidden, self.lm_head.weight, targets)
            else:
                lm = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
            w = self.rule.lm_loss_weight
            loss = (lm if w == 1.0 else w * lm) if aux is None else w * lm + aux
        return LoopedLMOutput(
            logits=logits,
            loss=loss,
            aux_loss=aux,
            lm_loss=lm,
            iterations=iterations,
            hidden=hidden if output_hidden else None,
            cache=cache,
            executed_loops=lctx.iteration + 1,
        )

    def _all_halted(self, state: dict, lctx: LoopContext) -> bool:
        halted = self.rule.halted(state, lctx)  # [B, T] bool or None
        if halted is None:
            return False
        if lctx.fctx.pad_mask is not None:  # padding never has to halt
            halted = halted | ~lctx.fctx.pad_mask
        return bool(halted.all())  # one host sync per iteration, only for rules that halt

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, **kwargs) -> torch.Tensor:
        """Decode ``max_new_tokens`` tokens (see :func:`looplm.decode.generate.generate` for all options)."""
        from .decode.generate import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
