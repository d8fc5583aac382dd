"""The self-contained remote code of an export: looplm's own plain-PyTorch modules, copied flat.

``AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)`` imports the modelling file named
in ``config.json``'s ``auto_map`` from transformers' module cache, into which the dynamic-module loader
(``transformers.dynamic_module_utils``) copies that file and, recursively, every sibling file named on a
line ``from .name import ...`` (``get_relative_imports``, a regular expression over the text); it checks
that every absolute import outside ``try`` blocks is installed (``check_imports``). Packages are not
copied, so an export carries looplm's model as flat sibling modules, one per looplm module::

    looplm/hf/remote/modeling_looplm.py   -> modeling_looplm.py        (the entry point, auto_map)
    looplm/hf/remote/configuration_looplm.py -> configuration_looplm.py
    looplm/model.py                       -> looplm_model.py
    looplm/layers/attention.py            -> looplm_layers_attention.py
    looplm/recurrence/__init__.py         -> looplm_recurrence.py       (a package: its __init__)
    looplm/hf/remote/no_kernels.py        -> looplm_kernels.py          (stands in for looplm.kernels)
    (generated)                           -> looplm_manifest.py         (what was carried, and from which source)

**Which modules.** The import closure of the entry points and of every recurrence rule (imports inside
functions count), so a new rule, layer or helper of the model is carried without being listed here.
Tools never are: reaching :data:`NOT_CARRIED` (kernels, trainer, data, eval, hf tools, CLI ...) is an
error naming the import chain — the model code must not need them. ``looplm.kernels`` is the one
substitution (:data:`SUBSTITUTES`): ``generate`` asks it to register the CPU fast paths, and the export's
stand-in registers none (fast paths are looplm's compiled C++; an installed looplm brings them, see
``looplm_source`` in :mod:`looplm.hf.remote.modeling_looplm`).

**How.** Each module's text is copied byte for byte except its looplm import statements, rewritten in
place (same line numbers as in looplm's source, so tracebacks point at the same lines)::

    from .blocks import Stack        (looplm/model.py)          -> from .looplm_blocks import Stack
    from ..config import RopeScaling (looplm/layers/rope.py)    -> from .looplm_config import RopeScaling
    from .. import dispatch          (looplm/layers/linear.py)  -> from . import looplm_dispatch as dispatch
    from . import history, injection (looplm/recurrence/...)    -> from . import looplm_recurrence_history as history, ...

A module imported as a module (``from . import x``) is not on a line transformers' pattern finds, so the
generated ``looplm_manifest.py`` names every file of the bundle in that form; the entry point imports it.
The result is deterministic (sorted, no dates): the same looplm source gives the same files, and
:func:`source_digest` of the carried sources is recorded, so an installed looplm whose source is the same
can be recognised at load time. Absolute imports of the carried code must be the standard library,
``torch``, ``transformers`` or ``yaml`` (a transformers dependency), checked here.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .remote.looplm_source import source_digest

__all__ = ["Bundle", "NOT_CARRIED", "SUBSTITUTES", "BundleError", "build_bundle", "export_name", "write_bundle"]

ENTRY = "looplm.hf.remote.modeling_looplm"
ROOTS = (ENTRY, "looplm.hf.remote.configuration_looplm", "looplm.recurrence")  # the rules register in recurrence/
# looplm's tools: an export's model code must never need them
NOT_CARRIED = (
    "looplm.kernels",
    "looplm.train",
    "looplm.data",
    "looplm.eval",
    "looplm.analysis",
    "looplm.tasks",
    "looplm.hf",
    "looplm.cli",
    "looplm.bench",
    "looplm.interop",
    "looplm.checkpoint_io",
    "looplm.parallel",
    "looplm.info",
    "looplm.utils",
)
CARRIED_TOOLS = ("looplm.hf.remote",)  # the remote-code package itself (inside looplm.hf)
SUBSTITUTES = {"looplm.kernels": "looplm.hf.remote.no_kernels"}  # module -> the source carried in its place
MANIFEST = "looplm_manifest"
ALLOWED_PACKAGES = frozenset({"torch", "transformers", "yaml", "__future__"})


class BundleError(RuntimeError):
    """The model code cannot be carried into an export as it is (the message names the module and import)."""


@dataclass
class Bundle:
    """The files of an export's remote code: ``files`` (file name -> text) and what they came from."""

    files: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # looplm module -> its name in the export
    sources: dict[str, str] = field(default_factory=dict)  # looplm module -> the looplm module whose text it is
    source_digest: str = ""


def package_dir() -> Path:
    """The directory of the ``looplm`` package whose source is bundled."""
    return Path(__file__).resolve().parents[1]


def _module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``: dotted name -> file (packages: their ``__init__.py``)."""
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def export_name(module: str) -> str:
    """The flat module name a looplm module has inside an export (see the module docstring)."""
    if module.startswith("looplm.hf.remote."):
        return module.rsplit(".", 1)[1]
    return module.replace(".", "_")


# ------------------------------------------------------------------------------------------------ imports
@dataclass
class _Import:
    node: ast.stmt
    module_imports: list[tuple[str, str]]  # (looplm module, bound name)
    attr_from: str | None  # looplm module the attribute names come from
    attr_names: list[ast.alias]


def _carried_kind(module: str) -> str:
    """``"carry"``, ``"substitute"`` or ``"refuse"`` for a looplm module the bundle reaches."""
    if module in SUBSTITUTES:
        return "substitute"
    if module.startswith(CARRIED_TOOLS):
        return "carry"
    if any(module == p or module.startswith(p + ".") for p in NOT_CARRIED):
        return "refuse"
    return "carry"


def _looplm_imports(module: str, path: Path, tree: ast.Module, mods: dict[str, Path]) -> list[_Import]:
    """The import statements of ``module`` that name looplm modules, resolved to dotted names."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name == "looplm" or a.name.startswith("looplm.")]
            if bad:
                raise BundleError(
                    f"{module} (line {node.lineno}): `import {bad[0]}` cannot be carried into an export; "
                    "import it relatively (`from .x import y`)"
                )
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == "looplm" or node.module.startswith("looplm.")):
            src = node.module
        else:
            continue
        if src == f"looplm.hf.remote.{MANIFEST}":  # written by the bundle itself, already a flat sibling
            continue
        imp = _Import(node, [], None, [])
        for alias in node.names:
            sub = f"{src}.{alias.name}"
            if sub in mods or sub in SUBSTITUTES:
                imp.module_imports.append((sub, alias.asname or alias.name))
            else:
                imp.attr_names.append(alias)
        if imp.attr_names:
            if src not in mods:
                raise BundleError(f"{module} (line {node.lineno}): imports from {src!r}, which is not a looplm module")
            imp.attr_from = src
        out.append(imp)
    return out


def _check_absolute_imports(name: str, tree: ast.Module) -> None:
    """The carried code may import the standard library, torch, transformers and yaml (outside ``try``)."""
    stdlib = set(sys.stdlib_module_names)

    def visit(node):
        if isinstance(node, ast.Try):
            return  # optional imports (mamba_ssm's CUDA kernels): transformers' check skips them too
        tops = []
        if isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module.split(".")[0]]
        for t in tops:
            if t not in stdlib and t not in ALLOWED_PACKAGES:
                raise BundleError(
                    f"{name} (line {node.lineno}): imports {t!r}; an export's remote code may only need the "
                    f"standard library and {sorted(ALLOWED_PACKAGES - {'__future__'})}"
                )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)


def _statement_text(imp: _Import, names: dict[str, str]) -> str:
    """The rewritten import statement (one line; ``;``-joined when it binds modules and attributes)."""
    parts = []
    if imp.attr_from is not None:
        names_txt = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in imp.attr_names)
        parts.append(f"from .{names[imp.attr_from]} import {names_txt}")
    if imp.module_imports:
        parts.append("from . import " + ", ".join(f"{names[m]} as {bound}" for m, bound in imp.module_imports))
    return "; ".join(parts)


def _rewrite(name: str, text: str, imports: list[_Import], names: dict[str, str]) -> str:
    """``text`` with each looplm import statement replaced in place (its lines kept: same line numbers)."""
    lines = text.splitlines(keepends=True)
    for imp in sorted(imports, key=lambda i: (i.node.lineno, i.node.col_offset), reverse=True):
        n = imp.node
        first, last = n.lineno - 1, n.end_lineno - 1
        head, tail = lines[first][: n.col_offset], lines[last][n.end_col_offset :]
        if head.strip() or (tail.strip() and not tail.strip().startswith("#")):
            raise BundleError(
                f"{name} (line {n.lineno}): an import that shares its line with other code cannot be rewritten; "
                "put it on a line of its own"
            )
        stmt = head + _statement_text(imp, names)
        if first == last:
            lines[first] = stmt + tail
        else:  # a parenthesised import over several lines: one line and blank ones (line numbers kept)
            lines[first] = stmt + "\n"
            lines[first + 1 : last] = ["\n"] * (last - first - 1)
            lines[last] = tail if tail.strip() else tail[len(tail.rstrip("\n")) :]
    return "".join(lines)


# ------------------------------------------------------------------------------------------------ the bundle
def build_bundle(root: Path | None = None, *, version: str | None = None) -> Bundle:
    """The remote-code files for an export of the looplm source at ``root`` (default: this package)."""
    root = Path(root) if root is not None else package_dir()
    mods = _module_files(root)
    texts: dict[str, str] = {}
    trees: dict[str, ast.Module] = {}
    imports: dict[str, list[_Import]] = {}
    sources: dict[str, str] = {}
    via: dict[str, str] = {}  # module -> the module that first imported it (for error messages)
    todo = list(ROOTS)
    while todo:
        mod = todo.pop()
        if mod in sources:
            continue
        kind = _carried_kind(mod)
        if kind == "refuse":
            chain = [mod]
            while chain[-1] in via:
                chain.append(via[chain[-1]])
            raise BundleError(
                f"the model code imports {mod!r} ({' <- '.join(chain)}); an export carries the plain-PyTorch model "
                f"only, never {', '.join(NOT_CARRIED)}. Move what the model needs into the model code"
            )
        src_mod = SUBSTITUTES.get(mod, mod)
        if src_mod not in mods:
            raise BundleError(f"looplm module {src_mod!r} (needed by {via.get(mod, 'the export')}) has no source file")
        sources[mod] = src_mod
        text = mods[src_mod].read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(mods[src_mod]))
        texts[mod], trees[mod] = text, tree
        imports[mod] = _looplm_imports(src_mod, mods[src_mod], tree, mods)
        if kind == "substitute" and imports[mod]:
            raise BundleError(f"{src_mod}, carried as {mod}, must not import looplm modules")
        for imp in imports[mod]:
            for dep in [m for m, _ in imp.module_imports] + ([imp.attr_from] if imp.attr_from else []):
                if dep not in sources:
                    via.setdefault(dep, mod)
                    todo.append(dep)
    names = {m: export_name(m) for m in sources}
    clash = {n for n in names.values() if list(names.values()).count(n) > 1}
    if clash:
        raise BundleError(f"looplm modules {sorted(m for m in names if names[m] in clash)} map to one export name")
    bundle = Bundle(modules=dict(sorted(names.items())), sources=dict(sorted(sources.items())))
    for mod in sorted(sources):
        out = _rewrite(sources[mod], texts[mod], imports[mod], names)
        _check_absolute_imports(names[mod], ast.parse(out))
        bundle.files[names[mod] + ".py"] = out
    raw = {sources[m]: mods[sources[m]].read_bytes() for m in sources}
    bundle.source_digest = source_digest(raw)
    bundle.files[MANIFEST + ".py"] = _manifest_text(bundle, version)
    bundle.files = dict(sorted(bundle.files.items()))
    return bundle


def _manifest_text(bundle: Bundle, version: str | None) -> str:
    lines = [
        '"""What this export\'s remote code is: looplm\'s plain-PyTorch model, copied flat by `looplm export hf`',
        "(looplm/hf/bundle.py). Generated; do not edit.",
        "",
        "``MANIFEST['modules']`` maps each looplm module to its file here; ``sources`` names the looplm module whose",
        "text each file is (the same but for looplm.kernels, which has a stand-in); ``source_digest`` is the",
        "SHA-256 of those sources, so an installed looplm with the same source can be recognised.",
        '"""',
        "",
        "MANIFEST = {",
        f'    "looplm_version": {version!r},',
        f'    "source_digest": {bundle.source_digest!r},',
        '    "modules": {',
        *[f"        {m!r}: {n!r}," for m, n in bundle.modules.items()],
        "    },",
        '    "sources": {',
        *[f"        {m!r}: {s!r}," for m, s in bundle.sources.items()],
        "    },",
        "}",
        "",
        "# Every file of the bundle on a line transformers' loader recognises (`from .name import ...`), so that it",
        "# copies modules that are imported as modules (`from . import looplm_dispatch as dispatch`) as well.",
        *[f"from .{n} import __name__ as _  # noqa: E402,F401" for m, n in bundle.modules.items() if m != ENTRY],
        "",
    ]
    return "\n".join(lines)


def write_bundle(out: str | Path, bundle: Bundle | None = None, *, version: str | None = None) -> Bundle:
    """Write the bundle's files into the export directory ``out``; checks with transformers' own loader
    functions that it will copy exactly these files and find no missing package."""
    out = Path(out)
    bundle = bundle or build_bundle(version=version)
    for fname, text in bundle.files.items():
        (out / fname).write_text(text, encoding="utf-8")
    from transformers.dynamic_module_utils import get_relative_import_files

    entry = out / (export_name(ENTRY) + ".py")
    found = {Path(f).name for f in get_relative_import_files(str(entry))}
    expected = set(bundle.files) - {entry.name}
    if found != expected:
        raise BundleError(
            f"transformers' loader would copy {sorted(found ^ expected)} differently from the bundle "
            f"(found {len(found)} of {len(expected)} files); a docstring line starting with `from .x import`?"
        )
    return bundle
