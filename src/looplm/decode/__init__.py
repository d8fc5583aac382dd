"""Decoding: full depth, sampling, per-token exit under three schedules, KV fill, self-speculation and the
one-forward exit — everything after training that turns a looped model into tokens.

The model's own parts (``looplm.model``, ``blocks``, ``cache``, ``context``, ``recurrence/``, ``layers/``)
never import this package, except :meth:`LoopedLM.generate`'s one call into :mod:`.generate`. Inside it,
imports go one way, down the floors (``tests/test_decode_layout.py`` holds it)::

    floor 5  generate         the entry: checks the arguments, resolves ``exit=`` / ``speculative=`` once
                              (an :class:`~.exits.Exit` / :class:`~.speculative.Speculative`) and picks the path
    floor 4  static_schedule  schedule='static': continuous depth batching at fixed shapes, no host reads
                              (CUDA graphs, or the pass through torch.compile)
    floor 3  depth_schedule   schedule='depth': continuous depth batching, each row at its own loop; request refill
             speculative      lossless self-speculation: an r_d-loop draft, one resuming verification forward
    floor 2  token_schedule   schedule='token': the batch decodes one token together, each row to its exit;
                              DepthStats (what ran); teacher forcing with exits (``AdaptiveDecoder.score``)
    floor 1  exit_forward     per-token exit in one parallel forward (a prompt: prefill='exit'; a scored text)
    floor 0  exits            the Exit spec, its checks, the criteria (gate, kl, convergence, replay)
             kv_fill          the fills of skipped loops carried into the next core call (kv='propagate')
             sampling         picking a token (greedy, temperature, top-k / top-p), eval mode, the fused decode steps
             scheduler        pure Python: rows, queue, admission, refill, KV budget, preemption (depth_schedule's run
                              and looplm.serve's engine both schedule through it)

Which path runs (``model.generate(ids, n, exit=..., speculative=...)``):

====================================  =========================================================================
call                                  path
====================================  =========================================================================
no ``exit``, no ``speculative``       full depth: ``generate``'s lean loop over ``LoopedLM.forward`` with caches
``exit`` that is off (ε = 0, q = 1)   the same lean loop, bit for bit (``Exit.is_off``)
``exit``, ``schedule='token'``        :class:`~.token_schedule.AdaptiveDecoder` (the default schedule)
``exit``, ``schedule='depth'``        :class:`~.depth_schedule.DepthBatchedDecoder` (``max_batch``: refill)
``exit``, ``schedule='static'``       :class:`~.static_schedule.StaticDepthDecoder` (``compile=True``, ``cuda_graphs``)
``exit``, ``prefill='exit'``          any schedule above; its prompt through :func:`~.exit_forward.adaptive_forward`
``speculative=r_d`` (or a spec)       :func:`~.speculative.speculative_generate` (its draft: an ``AdaptiveDecoder``)
====================================  =========================================================================

A token's way through an adaptive decoder: ``prompt`` (full depth, or ``prefill='exit'``) → the schedule
runs the core for the rows still looping → the **rule hooks** (``rule.begin`` after the prelude;
``next_input``, ``block_modulation``, ``step`` around each core pass; ``exit_rows`` / ``finish`` for the
rows that leave; ``select_rows`` for the static schedule's per-row loops) → the **criterion**
(:mod:`.exits`: which rows may stop after this loop) → the **fill** of the loops an exited token skipped
(``kv`` / ``ssm`` policy; :mod:`.kv_fill` carries ``propagate``'s into the next call) → coda, final norm and
**head** → :mod:`.sampling` picks the next token. The hooks are called in ``token_schedule`` (per loop, on
the rows still looping), ``depth_schedule`` (per cohort of rows at one loop), ``static_schedule`` (per loop
index on every row, each row keeping its own loop's result) and ``exit_forward`` (per loop, on each row's
pack of looping positions); none asks which rule it holds. ``docs/architecture.md`` draws the same map;
``docs/adaptive-depth.md`` is the user's guide.

Old import paths (``looplm.adaptive_forward``, ``looplm.exits``, ``looplm.depth_batch``, ...) still import
these modules, with a ``DeprecationWarning`` (:mod:`looplm._moved`).
"""
