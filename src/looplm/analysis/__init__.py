"""Looking inside looped models: one home for every analysis behind ``looplm analyze``.

* :mod:`.interventions` — StateLoop's state interventions (§5): read masking with exact Shapley
  values, calibrated replacement and freezing (eq. 15).
* :mod:`.trajectory` — the recurrence-effectiveness paper's trajectory metrics (appendix): angular
  distance, relative update norm, within-token variance and amplification factors, skip response.

Each analysis registers itself under a name with :func:`register_analysis`; ``looplm analyze
CHECKPOINT --metrics a,b`` (:mod:`.cli`) runs the named ones on held-out batches and writes one JSON
file and the paper-style PNG figures per analysis.

An analysis is a function ``fn(model, batches, options) -> dict`` where ``batches`` is a list of
``[B, T]`` token-id tensors and ``options`` a dict of command-line options (e.g. ``loops``); the
returned dict must be JSON-serialisable. A figure maker ``plot(result, out_dir) -> list[Path]`` is
optional. The extra ``--option`` keys an analysis reads are declared with ``register_analysis(...,
options=(...))``; ``looplm analyze`` refuses any other key, naming the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Analysis:
    name: str
    fn: Callable[..., dict]
    plot: Callable[..., list] | None = None
    help: str = ""
    options: tuple[str, ...] = ()  # the ``--option`` keys it reads (besides ``loops`` / ``calibration_batches``)


ANALYSES: dict[str, Analysis] = {}


def register_analysis(
    name: str, *, plot: Callable[..., list] | None = None, help: str = "", options: tuple[str, ...] = ()
):
    """Decorator: make ``fn(model, batches, options) -> dict`` available as ``looplm analyze --metrics NAME``.
    ``options``: the ``--option KEY=VALUE`` keys ``fn`` reads (``looplm analyze`` refuses any other)."""

    def deco(fn):
        ANALYSES[name] = Analysis(name, fn, plot, help or (fn.__doc__ or "").strip().split("\n")[0], tuple(options))
        return fn

    return deco


def load_all() -> dict[str, Any]:
    """Import every analysis module so that all registrations are present."""
    import importlib

    for mod in ("interventions", "trajectory"):
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a module not written yet
            if e.name != f"{__name__}.{mod}":
                raise
    return ANALYSES


__all__ = ["ANALYSES", "Analysis", "load_all", "register_analysis"]
