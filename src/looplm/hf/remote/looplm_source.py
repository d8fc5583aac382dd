"""Where an export's model code comes from: a digest of looplm sources, and whether an installed looplm has
the same source (then the export can run on it, with looplm's fast paths; see ``modeling_looplm``).

Carried into every export (``looplm_source.py``) and used by ``looplm export hf`` to record the digest, so
both sides compute it with this one function.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

__all__ = ["installed_package_dir", "module_file", "source_digest", "sources_digest"]


def source_digest(texts: dict[str, bytes]) -> str:
    """``sha256:<hex>`` over looplm module sources (dotted module name -> file bytes), in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(texts):
        h.update(name.encode() + b"\0" + hashlib.sha256(texts[name]).digest())
    return "sha256:" + h.hexdigest()


def installed_package_dir() -> Path | None:
    """The directory of an importable ``looplm`` package, found without importing it (``None``: not installed)."""
    try:
        spec = importlib.util.find_spec("looplm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def module_file(package_dir: Path, module: str) -> Path | None:
    """The source file of looplm module ``module`` (``looplm.layers.attention``) under ``package_dir``."""
    rel = Path(*module.split(".")[1:])
    for f in (package_dir / rel.with_suffix(".py"), package_dir / rel / "__init__.py"):
        if f.is_file():
            return f
    return None


def sources_digest(package_dir: Path, modules) -> str | None:
    """:func:`source_digest` of ``modules`` as found under ``package_dir`` (``None`` if one is missing)."""
    texts = {}
    for m in modules:
        f = module_file(package_dir, m)
        if f is None:
            return None
        texts[m] = f.read_bytes()
    return source_digest(texts)
