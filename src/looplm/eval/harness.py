"""lm-evaluation-harness for looped models: the ``looplm`` model, the papers' suites, local data.

``looplm eval harness CHECKPOINT --tasks ...`` (:mod:`looplm.eval.harness_cli`) runs lm-eval (0.4.x) on a looplm checkpoint (a run or
checkpoint directory, or a ``looplm export hf`` directory) at any loop count ``r`` and exit
threshold ``q``::

    looplm eval harness runs/demo --tasks looplm_mamba7 --data-dir ../shared/data/eval --limit 200
    looplm eval harness runs/demo --tasks my_task --include-path tasks/ --loops 6 --output-json out.json

The model (:class:`LoopLMEvalModel`, registered as ``looplm``; from Python:
``lm_eval.simple_evaluate(model="looplm", model_args="pretrained=runs/demo,loops=4")`` after
:func:`register_lm_eval_model`) implements lm-eval's ``TemplateLM``:

* ``loglikelihood`` — contexts and continuations tokenised together (lm-eval's ``_encode_pair``),
  scored in batches sorted by length, right-padded with an attention mask; an empty context is
  conditioned on the prefix token;
* ``loglikelihood_rolling`` — perplexity tasks: disjoint windows of ``max_length`` tokens, each
  token predicted once (lm-eval's rolling windows, the first token conditioned on the prefix token);
* ``generate_until`` — greedy (or sampled, per request) decoding with the per-(loop, layer) cache,
  left-padded batches, stopping at any ``until`` string, EOS or ``max_gen_toks`` tokens.

The prefix token follows lm-eval's own ``hf`` model, so the two score an export identically:
``prefix_token_id`` when given, else the tokenizer's BOS, else its EOS (looplm's byte tokenizer and
SmolLM2's have a BOS; a tokenizer without one — GPT-NeoX's — conditions on EOS, the document separator).

Model arguments: ``pretrained`` (path), ``loops`` (r, default the trained K), ``exit_threshold``
(q, passed as ``loop_options={"exit_threshold": q}``), ``dtype`` (``float32`` | ``bfloat16``),
``device``, ``batch_size``, ``max_length``, ``max_gen_toks``, ``prefix_token_id``; adaptive depth
(``docs/adaptive-depth.md``): ``exit`` (``gate:0.8``, ``kl:5e-4``, ...) — for ``loglikelihood`` /
``loglikelihood_rolling`` every scored token after the first takes the exits in one forward per batch
(:func:`looplm.decode.exit_forward.adaptive_forward`: what decoding the text token by token gives; the depths
in :attr:`LoopLMEvalModel.depth_stats`), for ``generate_until`` through ``generate`` — with ``kv_policy``,
``ssm_policy``, ``min_loops``, ``max_loops``, ``exit_schedule`` (``token`` | ``depth``: continuous depth
batching, ``batch_size`` rows at once with request refill: a row whose request finished takes the next
request of the same generation arguments | ``static``: the same at fixed shapes, for CUDA), or
``exit_prefill`` (``exit``: a generation's prompt takes the exits too), ``exit_compile`` (``true``: the static
schedule's pass through torch.compile), or ``speculative`` (draft loops)
with ``draft_k`` and ``draft_exit`` (generations only: lossless, so scoring stays full depth). Any other argument is refused, naming
the close matches (``loop=6`` is not silently ignored).

Suites (task groups written by :func:`write_task_configs`, scored with each task's headline metric,
unweighted means, printed in the papers' table layouts by :func:`suite_tables`):

* ``looplm_stateloop8_0shot`` / ``looplm_stateloop8_5shot`` — StateLoop Tab. 2: LAMBADA-OpenAI,
  ARC-E, ARC-C, WinoGrande, PIQA, HellaSwag, SciQ, RACE-high; accuracy; Avg-8;
* ``looplm_mamba7`` — Looped-Mamba Tab. 4/5: PIQA, BoolQ, WinoGrande, OBQA (5-shot), HellaSwag
  (10-shot), ARC-C (25-shot), ARC-E (8-shot); Avg;
* ``looplm_knowledge`` / ``looplm_reasoning`` / ``looplm_bbh14`` — the recurrence-effectiveness
  paper's groups (unweighted means of headline metrics, §B) and its 14 BBH subtasks (Tab. 6).
  The membership of Knowledge (3 tasks, PIQA among them) and Reasoning (8 tasks) is in the lost
  Tabs. 4-5; ours is a reading: Knowledge = PIQA, SciQ, ARC-E; Reasoning = ARC-C, HellaSwag,
  WinoGrande, BoolQ, OBQA, SIQA, CommonsenseQA, LAMBADA-OpenAI (change :data:`SUITES` to correct it).

``--data-dir DIR`` points lm-eval's own task definitions at local copies (``DIR/<task>/`` saved by
``datasets.save_to_disk``, read from its ``.arrow`` files; ``training_split: null`` so few-shot examples
come from the evaluation split, never the document itself): the suites' tasks and the plain task names
that have a copy (``--tasks arc_easy``); suite tasks without a local copy are skipped with a note.
Nothing touches the hub then. The task YAMLs (:func:`write_task_configs`, ``--write-tasks DIR``) are
lm-eval's own configs inlined, with data paths relative to ``DIR``: they name nothing of this machine.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # lm-eval is an optional dependency (pip install 'looplm[eval]')
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover - exercised only without lm-eval
    TemplateLM = object

__all__ = [
    "LoopLMEvalModel",
    "SUITES",
    "check_harness_args",
    "register_lm_eval_model",
    "run_harness",
    "suite_tables",
    "write_task_configs",
]


# ------------------------------------------------------------------------------------------ model
class LoopLMEvalModel(TemplateLM):
    """A looplm model for lm-eval (see the module docstring for the arguments)."""

    backend = "causal"

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model=None,
        tokenizer=None,
        loops: int | str | None = None,
        exit_threshold: float | str | None = None,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 8,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        prefix_token_id: int | str | None = None,
        max_batch_size: int | str | None = None,
        exit: str | None = None,
        kv_policy: str | None = None,
        ssm_policy: str | None = None,
        min_loops: int | str | None = None,
        max_loops: int | str | None = None,
        speculative: int | str | None = None,
        draft_k: int | str | None = None,
        exit_schedule: str | None = None,
        draft_exit: str | None = None,
        exit_prefill: str | None = None,
        exit_compile: bool | str | None = None,
        allow_deep: bool | str = False,
        **kwargs,
    ):
        if TemplateLM is object:
            raise ImportError("the lm-eval harness needs lm-eval: pip install 'looplm[eval]' (or pip install lm-eval)")
        if kwargs:  # before any loading: a misspelt argument (loop=6) must not be silently ignored
            from ..dataclass_util import _suggest

            known = sorted(MODEL_ARGS)
            raise ValueError(
                "looplm model: unknown argument(s) "
                + "; ".join(f"{k}={v!r}{_suggest(k, known)}" for k, v in kwargs.items())
                + f". Known: {', '.join(known)}"
            )
        super().__init__()
        if (pretrained is None) == (model is None):
            raise ValueError("LoopLMEvalModel needs pretrained=PATH (a checkpoint, run or export directory) or model=")
        # lm-eval passes model_args as strings ("max_length=0"): numbers first, then one check of them
        # all before the model is loaded (and once more against its max_seq_len after)
        loops, q, max_length = _number(loops, int), _number(exit_threshold, float), _number(max_length, int)
        batch_size = 8 if str(batch_size).startswith("auto") else _number(batch_size, int)
        max_gen_toks = _number(max_gen_toks, int)
        check_harness_args(
            loops=loops, exit_threshold=q, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks
        )
        prefix_id = _number(prefix_token_id, int)
        if prefix_id is not None and (not _is_int(prefix_id) or prefix_id < 0):
            raise ValueError(
                f"prefix_token_id must be a token id >= 0 (default: BOS, else EOS), got {prefix_token_id!r}"
            )
        if device in (None, "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if model is None:
            model, tokenizer, seq_len = load_for_eval(pretrained, tokenizer)
        else:
            from ..data.tokenizers import load_tokenizer

            if tokenizer is None:
                raise ValueError("model= needs tokenizer= (a looplm tokenizer or a spec such as 'byte')")
            tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
            seq_len = None
        dt = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "auto": None,
        }.get(str(dtype))
        if str(dtype) not in ("float32", "fp32", "bfloat16", "bf16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {dtype!r}")
        cfg_max = model.config.max_seq_len
        check_harness_args(
            loops=loops,
            exit_threshold=q,
            batch_size=batch_size,
            max_length=max_length,
            max_gen_toks=max_gen_toks,
            model_max_length=cfg_max,
        )
        allow_deep = {"true": True, "1": True, "false": False, "0": False}.get(str(allow_deep).lower(), allow_deep)
        if not isinstance(allow_deep, bool):
            raise ValueError(f"allow_deep must be true or false, got {allow_deep!r}")
        if _is_int(loops):  # (a typo such as loops=100000 would score for hours)
            from ..decode.exits import deep_loops_error

            why = deep_loops_error("loops (--loops)", loops, model.config.n_loops, allow_deep)
            if why is not None:
                raise ValueError(why.replace("(looplm: --allow-deep)", "(looplm eval harness: --allow-deep)"))
        if q is not None and "exit_threshold" not in getattr(model.rule, "loop_options", ()):
            raise ValueError(
                f"exit_threshold (--exit-threshold) {q}: this model has no exit gate (its recurrence rule is "
                f"{model.config.rule.name!r}); leave it out, or evaluate an exit_gate model"
            )
        self.model = model.to(device=device, dtype=dt).eval() if dt is not None else model.to(device).eval()
        self.tok = tokenizer
        self._device = torch.device(device)
        self.loops = loops
        self.loop_options = {"exit_threshold": q} if q is not None else None
        self.batch_size = batch_size
        self._max_length = max_length if max_length is not None else min(seq_len or cfg_max, cfg_max)
        self.max_gen_toks = max_gen_toks
        if prefix_id is not None and prefix_id >= self.model.config.vocab_size:
            raise ValueError(
                f"prefix_token_id must be a token id in [0, {self.model.config.vocab_size}), got {prefix_token_id}"
            )
        self.custom_prefix_token_id = prefix_id
        # loglikelihood requests scored with exit= (per-token exit in one forward): their depths, token-weighted
        self.depth_stats: dict = {}
        self.decode_options = adaptive_options(
            self.model,
            exit,
            kv_policy,
            ssm_policy,
            min_loops,
            max_loops,
            speculative,
            draft_k,
            exit_schedule,
            draft_exit,
            exit_prefill,
            exit_compile,
            allow_deep,
        )
        e = self.decode_options.get("exit")
        if e is not None and e.schedule == "depth" and not e.is_off(self.model):
            # rows decoded at once = batch_size; the group's other prompts queue for a free row
            self.decode_options = {**self.decode_options, "exit": replace(e, max_batch=batch_size)}

    # --- what lm-eval asks of a TemplateLM ---
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a document's first token are conditioned on: lm-eval's ``hf`` rule —
        ``prefix_token_id`` if given, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = getattr(self.tok, "bos_id", None)
        return bos if bos is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "name", "looplm")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tok.encode(string))  # looplm never adds special tokens

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tok.decode(list(tokens))

    # --- scoring ---
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Log-probabilities ``[B, T, V]`` (float32) of a right-padded batch; with ``exit`` every token after the
        first takes the exits, as decoding the text token by token would (:func:`looplm.decode.exit_forward.
        adaptive_forward`), and its depths are counted in :attr:`depth_stats`."""
        e = self.decode_options.get("exit")
        with torch.no_grad():
            if e is None:
                out = self.model(ids, attention_mask=mask, num_loops=self.loops, loop_options=self.loop_options).logits
            else:
                from ..decode.exit_forward import adaptive_forward, add_depth_stats

                if self.loops is not None and e.max_loops is None:
                    e = e.with_policies(max_loops=self.loops)
                res = adaptive_forward(
                    self.model, ids, e, attention_mask=mask, loop_options=self.loop_options, full_depth_prefix=1
                )
                out = res.logits
                add_depth_stats(self.depth_stats, res.stats)  # token-weighted over the batches
        return F.log_softmax(out.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``[(key, context_ids, continuation_ids)] -> [(sum log p(continuation), is_greedy)]``.

        A continuation longer than the window is scored in pieces, each token with as much of the
        text before it as fits in ``max_length`` tokens (no token goes unscored)."""
        L = self.max_length
        items = []  # (request index, input ids, number of predicted tokens, their targets)
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("an empty continuation cannot be scored")
            seq = list(ctx) + list(cont)
            pos = len(ctx)  # index in seq of the first token to predict
            while pos < len(seq):
                end = min(pos + L, len(seq))
                inp = seq[max(0, end - 1 - L) : end - 1]  # the model reads these ...
                items.append((i, inp, end - pos, seq[pos:end]))  # ... and predicts seq[pos:end] at its last positions
                pos = end
        order = sorted(range(len(items)), key=lambda k: -len(items[k][1]))  # longest first: similar lengths batch
        scores = [0.0] * len(requests)
        greedy = [True] * len(requests)
        from tqdm import tqdm

        for b in tqdm(range(0, len(order), self.batch_size), desc="looplm loglikelihood", disable=disable_tqdm):
            chunk = [items[k] for k in order[b : b + self.batch_size]]
            T = max(len(it[1]) for it in chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T, dtype=torch.long)
            for r, (_, inp, _, _) in enumerate(chunk):
                ids[r, : len(inp)] = torch.tensor(inp)
                mask[r, : len(inp)] = 1
            padded = bool((mask == 0).any())
            logp = self._forward(ids.to(self.device), mask.to(self.device) if padded else None)  # [B, T, V]
            for r, (i, inp, n, target) in enumerate(chunk):
                lp = logp[r, len(inp) - n : len(inp)]  # [n, V]: the predictions of the n target tokens
                tgt = torch.tensor(target, device=lp.device)
                scores[i] += float(lp.gather(-1, tgt[:, None]).sum())
                greedy[i] = greedy[i] and bool((lp.argmax(-1) == tgt).all())
        results = list(zip(scores, greedy))
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for (string,) in [req.args for req in requests]:
            windows = list(
                map(
                    utils.make_disjoint_window,
                    utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                )
            )
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for idxs in groups.values():
            kw = dict(requests[idxs[0]].args[1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            idxs = sorted(idxs, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            # continuous depth batching decodes the whole group through batch_size rows (request refill: a
            # finished row takes the next prompt); every other path decodes it in chunks of batch_size
            refills = getattr(self.decode_options.get("exit"), "max_batch", None) is not None
            step = len(idxs) if refills else self.batch_size
            for b in range(0, len(idxs), step):
                chunk = idxs[b : b + step]
                texts = self._generate([requests[i].args[0] for i in chunk], until, max_new, do_sample, temperature)
                for i, text in zip(chunk, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate(
        self, contexts: list[str], until: list[str], max_new: int, do_sample: bool, temperature: float
    ) -> list[str]:
        """Decode a left-padded batch with the per-(loop, layer) cache; cut each text at its first stop string."""
        from ..decode.generate import sample_next

        max_new = max(0, min(max_new, self.max_length - 1))
        prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] or [self.eot_token_id] for c in contexts]
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, T), self.eot_token_id, dtype=torch.long)
        mask = torch.zeros(B, T + max_new, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, T - len(p) :] = torch.tensor(p)
            mask[r, T - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        padded = bool((mask[:, :T] == 0).any())
        if self.decode_options:  # per-token exit / speculative decoding: looplm's generate, then the same cuts
            gen = self.model.generate(
                ids,
                max_new,
                attention_mask=mask[:, :T] if padded else None,
                do_sample=do_sample,
                temperature=temperature,
                eos_token_id=self.eot_token_id,
                loop_options=self.loop_options,
                num_loops=self.loops if "exit" in self.decode_options else None,
                **self.decode_options,
            )
            return [_cut(self.tok_decode(_until_eot(row, self.eot_token_id)), until) for row in gen[:, T:].tolist()]
        r = self.loops or self.model.config.n_loops
        cache = self.model.new_cache(B, r)
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        step = ids
        for t in range(max_new):
            n = T + t
            out = self.model(
                step,
                cache=cache,
                attention_mask=mask[:, :n] if padded else None,
                num_loops=r,
                loop_options=self.loop_options,
                logits_to_keep=1,
            )
            nxt = sample_next(out.logits[:, -1], do_sample, temperature, None, None)  # [B]
            for row in range(B):
                if done[row]:
                    continue
                tok = int(nxt[row])
                if tok == self.eot_token_id:
                    done[row] = True
                    continue
                new[row].append(tok)
                if until and any(s in self.tok_decode(new[row]) for s in until):
                    done[row] = True
            if all(done):
                break
            step = nxt[:, None]
        texts = []
        for row in range(B):
            text = self.tok_decode(new[row])
            for s in until:  # cut at the first stop string
                if s and s in text:
                    text = text.split(s)[0]
            texts.append(text)
        return texts


def _number(value, kind):
    """A model argument as ``kind`` (``int`` / ``float``); ``None`` for unset (lm-eval passes strings).
    A value that is not a number is returned as it is, for :func:`check_harness_args` to name."""
    if value in (None, "", "None"):
        return None
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return value
        return int(f) if kind is int and f.is_integer() else f
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_harness_args(
    *,
    loops=None,
    exit_threshold=None,
    num_fewshot=None,
    limit=None,
    batch_size=8,
    max_length=None,
    max_gen_toks=256,
    model_max_length: int | None = None,
) -> None:
    """One ``ConfigError`` naming every bad ``looplm eval harness`` argument, before any work starts
    (a ``max_length`` of 0 would never advance the scoring window)."""
    from ..dataclass_util import ConfigError

    errs = []
    if loops is not None and (not _is_int(loops) or loops < 1):
        errs.append(f"loops (--loops): must be an integer >= 1 (default: the trained K), got {loops!r}")
    if exit_threshold is not None and (
        isinstance(exit_threshold, bool) or not isinstance(exit_threshold, (int, float)) or not 0 <= exit_threshold <= 1
    ):
        errs.append(f"exit_threshold (--exit-threshold): must be a number in [0, 1], got {exit_threshold!r}")
    if num_fewshot is not None and (not _is_int(num_fewshot) or num_fewshot < 0):
        errs.append(f"num_fewshot (--num-fewshot): must be an integer >= 0, got {num_fewshot!r}")
    if limit is not None:
        ok = isinstance(limit, (int, float)) and not isinstance(limit, bool) and math.isfinite(limit) and limit > 0
        if not ok or (limit >= 1 and not float(limit).is_integer()):
            errs.append(f"limit (--limit): must be a document count >= 1 or a fraction in (0, 1), got {limit!r}")
    if not _is_int(batch_size) or batch_size < 1:
        errs.append(f"batch_size (--batch-size): must be an integer >= 1, got {batch_size!r}")
    if max_length is not None:
        top = f" and at most the model's max_seq_len={model_max_length}" if model_max_length else ""
        if not _is_int(max_length) or max_length < 1 or (model_max_length and max_length > model_max_length):
            errs.append(
                f"max_length (--max-length): the window of tokens the model reads must be an integer >= 1{top}, "
                f"got {max_length!r}"
            )
    if not _is_int(max_gen_toks) or max_gen_toks < 1:
        errs.append(f"max_gen_toks: must be an integer >= 1, got {max_gen_toks!r}")
    if errs:
        raise ConfigError(errs, "eval harness arguments")


# the model arguments LoopLMEvalModel takes (lm-eval adds batch_size, max_batch_size and device itself)
MODEL_ARGS = (
    "pretrained",
    "model",
    "tokenizer",
    "loops",
    "exit_threshold",
    "dtype",
    "device",
    "batch_size",
    "max_length",
    "max_gen_toks",
    "prefix_token_id",
    "max_batch_size",
    "exit",
    "kv_policy",
    "ssm_policy",
    "min_loops",
    "max_loops",
    "exit_schedule",
    "speculative",
    "draft_k",
    "draft_exit",
    "exit_prefill",
    "exit_compile",
    "allow_deep",
)


def adaptive_options(
    model,
    exit=None,
    kv_policy=None,
    ssm_policy=None,
    min_loops=None,
    max_loops=None,
    speculative=None,
    draft_k=None,
    exit_schedule=None,
    draft_exit=None,
    exit_prefill=None,
    exit_compile=None,
    allow_deep: bool = False,
) -> dict:
    """``generate()`` keyword arguments from the lm-eval model's string arguments (checked now, before any
    request; :func:`looplm.decode.generate.adaptive_options`): ``{"exit": Exit}``, ``{"speculative": Speculative}`` or ``{}``."""
    from ..decode.generate import adaptive_options as resolve

    none = (None, "", "None")
    text = lambda v: None if v in none else str(v)  # noqa: E731
    num = lambda v: None if v in none else int(v)  # noqa: E731
    flags = {"true": True, "1": True, "false": False, "0": False, "": False, "none": False}
    on = flags.get(exit_compile.lower()) if isinstance(exit_compile, str) else exit_compile or False
    if not isinstance(on, bool):
        raise ValueError(f"exit_compile must be true or false, got {exit_compile!r}")
    return resolve(
        model,
        exit=text(exit),
        speculative=num(speculative),
        draft_k=num(draft_k),
        kv=text(kv_policy),
        ssm=text(ssm_policy),
        min_loops=num(min_loops),
        max_loops=num(max_loops),
        schedule=text(exit_schedule),
        draft_exit=text(draft_exit),
        prefill=text(exit_prefill),
        compile=on or None,
        allow_deep=allow_deep,
    )


def _until_eot(ids: list[int], eot: int) -> list[int]:
    return ids[: ids.index(eot)] if eot in ids else ids


def _cut(text: str, until: list[str]) -> str:
    for s in until:  # cut at the first stop string
        if s and s in text:
            text = text.split(s)[0]
    return text


def load_for_eval(path, tokenizer=None):
    """``(model, tokenizer, training seq_len or None)`` from a checkpoint / run directory or an HF export."""
    p = Path(path)
    cfg_file = p / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("model_type") == "looplm":
        from ..hf.importer import read_export

        model, tok = read_export(p)
        return model, tokenizer or tok, None
    from ..checkpoint_io import load_model_for_inference, read_checkpoint_config

    model, tok = load_model_for_inference(p, tokenizer=tokenizer)
    seq_len = read_checkpoint_config(p).get("train", {}).get("data", {}).get("seq_len")
    return model, tok, seq_len


def register_lm_eval_model() -> None:
    """Register :class:`LoopLMEvalModel` as lm-eval's ``looplm`` model (idempotent).

    lm-eval 0.4.x has no plugin entry point: ``lm_eval.models`` must be imported first (it fills the
    registry with the built-in models; registering before would leave only ours). The entry point
    ``lm_eval.models: looplm`` is declared in ``pyproject.toml`` for releases that read it.
    """
    import lm_eval.models  # noqa: F401  # (the built-in models register themselves on import)
    from lm_eval.api.registry import get_model, register_model

    try:
        if get_model("looplm") is LoopLMEvalModel:
            return
    except (KeyError, ValueError):
        pass
    register_model("looplm")(LoopLMEvalModel)


# ------------------------------------------------------------------------------------------ suites
@dataclass(frozen=True)
class SuiteTask:
    task: str  # lm-eval's task name
    label: str  # the papers' column header
    shots: int = 0
    metric: str = "acc"  # the headline metric


_SL8 = [
    ("lambada_openai", "LAMBADA OAI"),
    ("arc_easy", "ARC-E"),
    ("arc_challenge", "ARC-C"),
    ("winogrande", "WinoG."),
    ("piqa", "PIQA"),
    ("hellaswag", "Hella."),
    ("sciq", "SciQ"),
    ("race", "RACE"),
]
BBH14 = [
    "causal_judgement",
    "date_understanding",
    "disambiguation_qa",
    "hyperbaton",
    "logical_deduction_five_objects",
    "logical_deduction_three_objects",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "salient_translation_error_detection",
    "snarks",
    "temporal_sequences",
    "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects",
    "tracking_shuffled_objects_three_objects",
]

# suite name -> (title, average column header, tasks)
SUITES: dict[str, tuple[str, str, list[SuiteTask]]] = {
    "looplm_stateloop8_0shot": (
        "StateLoop Tab. 2, zero-shot accuracy (%)",
        "Avg-8",
        [SuiteTask(t, name, 0) for t, name in _SL8],
    ),
    "looplm_stateloop8_5shot": (
        "StateLoop Tab. 2, five-shot accuracy (%)",
        "Avg-8",
        [SuiteTask(t, name, 5) for t, name in _SL8],
    ),
    "looplm_mamba7": (
        "Looped-Mamba Tab. 4, accuracy (%)",
        "Avg.",
        [
            SuiteTask("piqa", "PIQA", 5),
            SuiteTask("boolq", "BoolQ", 5),
            SuiteTask("winogrande", "WinoGrande", 5),
            SuiteTask("openbookqa", "OBQA", 5),
            SuiteTask("hellaswag", "HellaSwag", 10),
            SuiteTask("arc_challenge", "ARC-C", 25),
            SuiteTask("arc_easy", "ARC-E", 8),
        ],
    ),
    "looplm_knowledge": (
        "Recurrence paper, Knowledge group (%)",
        "Knowledge",
        [SuiteTask("piqa", "PIQA"), SuiteTask("sciq", "SciQ"), SuiteTask("arc_easy", "ARC-E")],
    ),
    "looplm_reasoning": (
        "Recurrence paper, Reasoning group (%)",
        "Reasoning",
        [
            SuiteTask("arc_challenge", "ARC-C"),
            SuiteTask("hellaswag", "HellaSwag"),
            SuiteTask("winogrande", "WinoGrande"),
            SuiteTask("boolq", "BoolQ"),
            SuiteTask("openbookqa", "OBQA"),
            SuiteTask("siqa", "SIQA"),
            SuiteTask("commonsense_qa", "CSQA"),
            SuiteTask("lambada_openai", "LAMBADA"),
        ],
    ),
    "looplm_bbh14": (
        "Recurrence paper, 14 BBH subtasks, 3-shot exact match (%)",
        "BBH-14",
        [SuiteTask(f"bbh_fewshot_{t}", t, 3, "exact_match") for t in BBH14],
    ),
}

# lm-eval task -> its YAML under lm_eval/tasks (included by our wrappers), and the local folder name
_BUILTIN_YAML = {
    "lambada_openai": "lambada/lambada_openai.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "winogrande": "winogrande/default.yaml",
    "piqa": "piqa/piqa.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "sciq": "sciq/sciq.yaml",
    "race": "race/race.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "siqa": "siqa/siqa.yaml",
    "commonsense_qa": "commonsense_qa/default.yaml",
    **{f"bbh_fewshot_{t}": f"bbh/fewshot/{t}.yaml" for t in BBH14},
}
LOCAL_DIRS = {
    "lambada_openai": "lambada-openai",
    "arc_easy": "arc-easy",
    "arc_challenge": "arc-challenge",
    "winogrande": "winogrande",
    "piqa": "piqa",
    "hellaswag": "hellaswag",
    "sciq": "sciq",
    "boolq": "boolq",
    "openbookqa": "openbookqa",
}
_LOCAL_FIXES = {"boolq": {"doc_to_target": "{{answer|int}}"}}  # the local copy has a bool `answer`, not `label`


def _local_overrides(task: str, data_dir: Path, out_dir: Path) -> dict | None:
    """Config fields that point ``task`` at ``data_dir/<task>/`` (``None`` if there is no local copy). The
    ``.arrow`` files are named relative to ``out_dir`` (where the YAML is written) and read by
    :data:`LOCAL_DATA_MODULE` next to the YAML, so the folder of YAMLs moves with its data."""
    sub = LOCAL_DIRS.get(task)
    if sub is None:
        return None
    arrows = sorted((data_dir / sub).glob("*.arrow"))
    if not arrows:
        return None
    split = "test" if task == "lambada_openai" else "validation"
    rel = [os.path.relpath(a.resolve(), out_dir.resolve()) for a in arrows]
    ov = {
        "dataset_path": "arrow",
        "dataset_name": None,
        "custom_dataset": _Function(f"{LOCAL_DATA_MODULE}.load"),
        "dataset_kwargs": {"data_files": {split: rel}},
        "training_split": None,
        "validation_split": split if split == "validation" else None,
        "test_split": split if split == "test" else None,
        "fewshot_split": split,
    }
    ov.update(_LOCAL_FIXES.get(task, {}))
    return ov


# the reader of local task data written next to the YAMLs (self-contained: lm_eval --include_path needs no looplm)
LOCAL_DATA_MODULE = "_looplm_local_data"
_LOCAL_DATA_SOURCE = '''"""Local copies of lm-eval tasks' data for the task YAMLs in this folder (written by
``looplm eval harness --write-tasks``): the ``custom_dataset`` of each YAML. A YAML's ``data_files`` are
relative to this folder, so the folder can move together with the data."""

from pathlib import Path


def load(data_files=None, **_metadata):
    """The ``.arrow`` files of ``data_files`` (split -> paths relative to this folder) as a DatasetDict."""
    import datasets

    here = Path(__file__).resolve().parent
    files = {split: [str((here / f).resolve()) for f in paths] for split, paths in (data_files or {}).items()}
    return datasets.load_dataset("arrow", data_files=files)
'''


class _Function:
    """A ``!function`` reference of an lm-eval task YAML, kept as the importable name it resolves to."""

    def __init__(self, name: str):
        self.name = name


def _task_yaml_loader(lm_eval_tasks: Path, base: Path):
    """A YAML loader for lm-eval's task files: ``!function utils.f`` next to ``base`` becomes the importable
    ``lm_eval.tasks.<dir>.utils.f`` (lm-eval resolves both forms), anything else is plain YAML."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def function(loader, node):
        spec = loader.construct_scalar(node)
        rel = base.resolve().relative_to(lm_eval_tasks.resolve())
        return _Function(".".join(["lm_eval", "tasks", *rel.parts, spec]))

    Loader.add_constructor("!function", function)
    return Loader


def _lm_eval_task_config(path: Path, lm_eval_tasks: Path) -> dict:
    """lm-eval's task YAML ``path`` with its ``include``-s merged in (as lm-eval merges them: included first,
    local keys win, an included ``task_list`` dropped) and its functions as importable names — so a task
    YAML written from it names nothing of this environment."""
    import yaml

    cfg = yaml.load(path.read_text(), Loader=_task_yaml_loader(lm_eval_tasks, path.parent))  # noqa: S506
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_cfg = _lm_eval_task_config(path.parent / inc if not Path(inc).is_absolute() else Path(inc), lm_eval_tasks)
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
    merged.update(cfg)
    return merged


def _dump_task_yaml(cfg: dict) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Function, lambda d, f: d.represent_scalar("!function", f.name))
    return yaml.dump(cfg, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def write_task_configs(
    out_dir: str | Path, data_dir: str | Path | None = None
) -> dict[str, list[tuple[str, SuiteTask]]]:
    """Write one task YAML per (suite task, shots) and one group YAML per suite into ``out_dir``; with
    ``data_dir``, also one per plain task name that has a local copy (``arc_easy.yaml``: ``--tasks arc_easy``
    then reads the local data instead of the hub, overriding lm-eval's own definition of that name).

    Each task YAML is lm-eval's own task config (its includes merged, its functions named by their
    importable ``lm_eval.tasks...`` names) with ``num_fewshot`` set and, with ``data_dir``, the local dataset
    (paths relative to ``out_dir``); nothing in them names this environment, so the folder (with its data)
    works on another machine with lm-eval installed. A suite task has its own name (``<suite>_<task>``,
    aliased to the task's name) so the same task can run in several suites (and at several shot counts) in
    one evaluation. Returns, per suite, the ``(task name, SuiteTask)`` pairs written (tasks without a local
    copy are left out).
    """
    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(data_dir) if data_dir is not None else None
    if data is not None:
        (out / f"{LOCAL_DATA_MODULE}.py").write_text(_LOCAL_DATA_SOURCE)
    sources: dict[str, dict] = {}

    def task_config(task: str) -> dict:
        if task not in sources:
            src = root / _BUILTIN_YAML[task]
            if not src.is_file():
                raise FileNotFoundError(f"lm-eval has no {src} (task {task!r}); this lm-eval version is not supported")
            sources[task] = _lm_eval_task_config(src, root)
        return dict(sources[task])

    written: dict[str, list[tuple[str, SuiteTask]]] = {}
    done: set[str] = set()
    for suite, (_, _, tasks) in SUITES.items():
        members = []
        for st in tasks:
            name = f"{suite}_{st.task}" + ("_local" if data is not None else "")  # one per suite: lm-eval refuses
            # a task that appears in two groups of one evaluation (mamba7 and stateloop8_5shot share 5-shot PIQA)
            if name not in done:
                cfg = task_config(st.task)
                cfg.update(task=name, task_alias=st.task, num_fewshot=st.shots)
                if data is not None:
                    ov = _local_overrides(st.task, data, out)
                    if ov is None:
                        continue
                    cfg.update(ov)
                cfg["tag"] = []  # not in the included task's tags (ai2_arc, ...)
                (out / f"{name}.yaml").write_text(_dump_task_yaml(cfg))
                done.add(name)
            members.append((name, st))
        if members:
            group = {
                "group": suite,
                "task": [m for m, _ in members],
                "aggregate_metric_list": [{"metric": tasks[0].metric, "aggregation": "mean", "weight_by_size": False}],
                "metadata": {"version": 1.0},
            }
            (out / f"_{suite}.yaml").write_text(_dump_task_yaml(group))
            written[suite] = members
    if data is not None:  # plain names: lm-eval's task itself on the local copy (its own shots)
        for task in sorted(LOCAL_DIRS):
            ov = _local_overrides(task, data, out)
            if ov is not None:
                cfg = task_config(task)
                cfg.update(ov)
                cfg.update(task=task, tag=[])
                (out / f"{task}.yaml").write_text(_dump_task_yaml(cfg))
    return written


def suite_tables(results: dict, suites: dict[str, list[tuple[str, SuiteTask]]], model_name: str = "model") -> str:
    """Markdown tables in the papers' layouts (one row: the model; columns: the tasks; the mean) for
    every suite whose tasks ran. Scores are ``100 × headline metric``; the mean is unweighted."""
    lines = []
    res = results.get("results", {})
    for suite, members in suites.items():
        title, avg_name, all_tasks = SUITES[suite]
        ran = {st: name for name, st in members}
        cells, vals = [], []
        for st in all_tasks:  # every column of the paper's table; "–" where the task did not run
            name = ran.get(st)
            r = None if name is None else res.get(name)
            v = None if r is None else r.get(f"{st.metric},none", r.get(st.metric))
            if v is None and r is not None and st.metric == "exact_match":
                v = r.get("exact_match,get-answer")
            cells.append((st.label, v))
            if isinstance(v, (int, float)):
                vals.append(float(v))
        if not vals:
            continue
        lines.append(f"**{title}** ({len(vals)} of {len(SUITES[suite][2])} tasks)")
        lines.append("| Model | " + " | ".join(label for label, _ in cells) + f" | {avg_name} |")
        lines.append("| --- |" + " ---: |" * (len(cells) + 1))
        fmt = [f"{100 * v:.2f}" if isinstance(v, (int, float)) else "–" for _, v in cells]
        lines.append(f"| {model_name} | " + " | ".join(fmt) + f" | {100 * sum(vals) / len(vals):.2f} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ running
def run_harness(
    checkpoint,
    tasks: list[str],
    *,
    loops=None,
    exit_threshold=None,
    num_fewshot=None,
    limit=None,
    include_path=None,
    data_dir=None,
    output_json=None,
    batch_size=8,
    device=None,
    dtype="float32",
    max_length=None,
    seed: int = 1234,
    task_dir=None,
    include_defaults: bool | None = None,
    log_samples: bool = False,
    prefix_token_id: int | None = None,
    exit: str | None = None,
    kv_policy: str | None = None,
    ssm_policy: str | None = None,
    min_loops: int | None = None,
    max_loops: int | None = None,
    allow_deep: bool = False,
) -> dict:
    """Evaluate ``checkpoint`` on ``tasks`` (task, group or suite names); returns lm-eval's results dict
    with ``looplm_tables`` (the suites' tables) added, and writes it to ``output_json`` when given.

    With ``data_dir``, a plain task name that has a local copy there (``arc_easy``) runs on it.
    ``log_samples``: every scored document, as lm-eval logs them, one JSON line each, into
    ``<output_json without .json>_samples_<task>.jsonl`` (needs ``output_json``; the paths are listed under
    ``samples_files``). ``include_defaults``: index lm-eval's own task folder too (slow: thousands of
    YAMLs); ``None`` = only when a requested task is neither a suite nor in ``include_path`` / ``data_dir``.
    ``exit`` (with ``kv_policy`` ...): per-token exit for every request — scored texts in one forward per batch
    (:func:`looplm.decode.exit_forward.adaptive_forward`), generations with ``generate``; the scored tokens'
    depths are in ``adaptive_depth`` (selected / executed depth, their ratio to ``max_loops``)."""
    import tempfile

    check_harness_args(
        loops=loops,
        exit_threshold=exit_threshold,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        max_length=max_length,
    )
    if log_samples and not output_json:
        raise ValueError("log_samples needs output_json (the samples are written next to it); pass --output-json")
    import lm_eval
    from lm_eval.tasks import TaskManager

    register_lm_eval_model()
    tmp = tempfile.TemporaryDirectory(prefix="looplm-tasks-") if task_dir is None else None
    suite_dir = Path(task_dir or tmp.name)
    suites = write_task_configs(suite_dir, data_dir)
    paths = [str(suite_dir)] + [str(p) for p in (include_path or [])]
    local = TaskManager(include_path=paths, include_defaults=False)
    needs_defaults = any(not local.match_tasks([t]) for t in tasks) if include_defaults is None else include_defaults
    tm = TaskManager(include_path=paths, include_defaults=True) if needs_defaults else local
    missing = [t for t in tasks if not tm.match_tasks([t])]
    if missing:
        hint = " (suites: " + ", ".join(SUITES) + ")"
        if data_dir is not None:
            hint += f"; with --data-dir only tasks with a local copy run ({', '.join(sorted(LOCAL_DIRS))})"
        raise ValueError(f"unknown task(s) {missing}{hint}")
    if limit is not None and limit >= 1:
        limit = int(limit)
    lm = LoopLMEvalModel(
        str(checkpoint),
        loops=loops,
        exit_threshold=exit_threshold,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        max_length=max_length,
        prefix_token_id=prefix_token_id,
        exit=exit,
        kv_policy=kv_policy,
        ssm_policy=ssm_policy,
        min_loops=min_loops,
        max_loops=max_loops,
        allow_deep=allow_deep,
    )
    t0 = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=tm,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        log_samples=log_samples,
    )
    if tmp is not None:
        tmp.cleanup()
    ran = {s: m for s, m in suites.items() if s in tasks}
    out = {k: results[k] for k in ("results", "groups", "n-shot", "versions", "n-samples") if k in results}
    out["config"] = {
        "checkpoint": str(checkpoint),
        "tasks": list(tasks),
        "loops": loops or lm.model.config.n_loops,
        "exit_threshold": exit_threshold,
        "num_fewshot": num_fewshot,
        "limit": limit,
        "data_dir": str(data_dir) if data_dir else None,
        "max_length": lm.max_length,
        "time_s": time.perf_counter() - t0,
    }
    out["config"]["prefix_token_id"] = lm.prefix_token_id
    e = lm.decode_options.get("exit")
    out["config"]["exit"] = (
        None
        if e is None
        else {
            "criterion": e.criterion,
            "threshold": e.threshold,
            "kv": e.kv,
            "ssm": e.ssm,
            "min_loops": e.min_loops,
            "max_loops": e.max_loops,
        }
    )
    if lm.depth_stats:
        out["adaptive_depth"] = dict(lm.depth_stats)
    out["looplm_tables"] = suite_tables(out, ran, model_name=Path(str(checkpoint)).name)
    if log_samples:
        out["samples_files"] = _write_samples(results.get("samples") or {}, Path(output_json))
    if output_json:
        Path(output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(output_json).write_text(json.dumps(out, indent=2, default=_json_default))
    return out


def _write_samples(samples: dict, output_json: Path) -> dict[str, str]:
    """lm-eval's logged samples, one JSON line per document, ``<output_json stem>_samples_<task>.jsonl``."""
    try:
        from lm_eval.utils import handle_non_serializable as default
    except ImportError:  # pragma: no cover - older lm-eval
        default = _json_default
    files = {}
    output_json.parent.mkdir(parents=True, exist_ok=True)
    for task, rows in sorted(samples.items()):
        f = output_json.with_name(f"{output_json.stem}_samples_{task}.jsonl")
        f.write_text("".join(json.dumps(r, default=default, ensure_ascii=False) + "\n" for r in rows))
        files[task] = str(f)
    return files


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)
