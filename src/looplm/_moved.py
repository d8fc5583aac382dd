"""Import paths that moved: the old name still imports the module, with a ``DeprecationWarning``.

The decoding modules left the package root for :mod:`looplm.decode` (issue #46), and the benchmarks for
:mod:`looplm.bench`. ``import looplm.adaptive_forward`` (or ``from looplm.exits import Exit``) keeps
working: a finder on ``sys.meta_path`` answers exactly the names of :data:`MOVED`, imports the new module
and puts *that module object* under the old name in ``sys.modules`` (so ``looplm.exits is
looplm.decode.exits``: a monkeypatch through either name reaches the same functions). A module replacing
itself in ``sys.modules`` while it executes is the import system's documented behaviour; no file is left
at the old path. The old names go in a later release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old dotted name -> new dotted name
MOVED = {
    "looplm.generate": "looplm.decode.generate",
    "looplm.sampling": "looplm.decode.sampling",
    "looplm.exits": "looplm.decode.exits",
    "looplm.adaptive": "looplm.decode.token_schedule",
    "looplm.depth_batch": "looplm.decode.depth_schedule",
    "looplm.depth_static": "looplm.decode.static_schedule",
    "looplm.kv_fill": "looplm.decode.kv_fill",
    "looplm.speculative": "looplm.decode.speculative",
    "looplm.adaptive_forward": "looplm.decode.exit_forward",
    "looplm.bench_adaptive": "looplm.bench.adaptive",
}


def _warn(old: str) -> None:
    warnings.warn(
        f"{old} moved to {MOVED[old]}: import it from there ({old} goes in a later release)",
        DeprecationWarning,
        stacklevel=3,
    )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return None  # a plain module, replaced in exec_module

    def exec_module(self, module) -> None:
        _warn(module.__name__)
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_attribute(name: str):
    """``looplm.<old name>`` as an attribute (``import looplm; looplm.adaptive_forward``): the new module."""
    old = f"looplm.{name}"
    if old not in MOVED:
        raise AttributeError(f"module 'looplm' has no attribute {name!r}")
    return importlib.import_module(old)
