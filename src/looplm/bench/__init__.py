"""``looplm bench``: the benchmarks, one module (or package) per sub-command.

* :mod:`looplm.bench.decode` — ``looplm bench decode``: the decoding-latency study of the StateLoop paper
  (Tab. 3 protocol: Vanilla Looped K = 4 / 5, + FFN, StateLoop with identity / attention / Mamba-2 mixers);
* :mod:`looplm.bench.adaptive` — ``looplm bench adaptive``: what per-token exit and self-speculative decoding
  really save against full depth, on models trained here (a package, one module per section);
* :mod:`looplm.bench.serve` — ``looplm bench serve``: ``looplm serve`` under load (throughput, TTFT / ITL,
  loops per token, KV per request) against one-at-a-time, ``model.generate`` and ``transformers serve``.

Importing this package stays light (``looplm --help`` imports it): :mod:`looplm.bench.adaptive`, which
imports torch, is imported only when :func:`register` adds its sub-command.
"""

from __future__ import annotations

from .decode import DECODE_MODELS, build_decode_models, cpu_description, decode_latency
from .decode import register as _register_decode

__all__ = ["DECODE_MODELS", "build_decode_models", "cpu_description", "decode_latency", "register"]


def register(subparsers) -> None:
    """Add ``looplm bench`` (``decode``, ``adaptive``) to the ``looplm`` command line."""
    p = subparsers.add_parser(
        "bench",
        help="benchmarks (decode: the StateLoop decoding-latency study, Tab. 3; adaptive: per-token exit and self-speculative decoding; serve: the server under load)",
    )
    sub = p.add_subparsers(dest="bench_command", required=True)
    _register_decode(sub)
    from .adaptive import register as register_adaptive
    from .serve import register as register_serve

    register_adaptive(sub)
    register_serve(sub)
