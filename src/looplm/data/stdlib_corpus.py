"""The embedded default corpus: docstrings of the installed Python standard library.

Every machine that runs looplm has a Python interpreter, and the standard library carries a few
megabytes of carefully written English prose about programming. That makes it a corpus that needs
no download, no network and no files: good for demos, smoke tests and CI.

How it is built (see :func:`collect_stdlib_docs`):

* walk ``sys.stdlib_module_names`` (public names only, sorted) and the submodules of packages,
  skipping a denylist of modules with side effects on import (``antigravity`` opens a browser,
  ``this`` prints the Zen, GUI toolkits, the regression-test suite, ``__main__`` modules, ...);
* import each module in a **separate, isolated interpreter** (``python -I -S``), so stray prints,
  signal handlers, warnings or ``sys.modules`` pollution never reach the training process;
* collect module, class, function and method docstrings with :func:`inspect.getdoc`, only for
  objects defined in that module (no re-exports), in a deterministic order;
* drop very short docstrings (< ``min_chars`` characters) and exact duplicates (first wins).

Each docstring is one document. The result depends on the Python version and on which optional
C extensions the interpreter was built with, but is deterministic for one interpreter. Nothing is
written to disk; the list is cached in memory for the life of the process.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Modules (and packages: the name and everything below it) never imported while collecting.
STDLIB_DENYLIST: frozenset[str] = frozenset(
    {
        "antigravity",  # opens a web browser
        "this",  # prints the Zen of Python
        "__hello__",
        "__phello__",
        "idlelib",  # GUI
        "tkinter",
        "turtle",
        "turtledemo",
        "test",  # the CPython regression suite: huge, and some modules act on import
        "lib2to3",  # deprecated, emits warnings, grammar pickles written on import
        "distutils",
        "ensurepip",
        "venv",
        "pydoc_data",  # one huge generated topics dict, not prose per object
        "msilib",
        "winreg",
        "winsound",
        "nturl2path",
        "msvcrt",
        "_msi",
        "readline",  # may write terminal escape codes
        "rlcompleter",
        "pty",
        "tty",
        "curses",
        "ossaudiodev",
        "sre_compile",  # deprecated aliases of re._compiler etc.
        "sre_constants",
        "sre_parse",
    }
)

# Submodule name parts that are never imported (test suites, script entry points).
_DENIED_PARTS = frozenset({"__main__", "test", "tests", "idle_test", "_test"})

# Runs in the child interpreter. Reads a JSON config from argv[1], prints one marker line + JSON.
_CHILD_CODE = r"""
import contextlib, importlib, inspect, io, json, pkgutil, sys, types, warnings
cfg = json.loads(sys.argv[1])
deny = set(cfg["deny"]); deny_parts = set(cfg["deny_parts"]); min_chars = cfg["min_chars"]
real_stdout = sys.stdout

def denied(name):
    parts = name.split(".")
    if any(p in deny_parts for p in parts):
        return True
    return any(".".join(parts[:i]) in deny for i in range(1, len(parts) + 1))

def safe_import(name):
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # ImportError, platform errors, even SystemExit: just skip the module
        return None

def module_names():
    out = []
    for top in sorted(n for n in sys.stdlib_module_names if not n.startswith("_")):
        if denied(top):
            continue
        mod = safe_import(top)
        if mod is None:
            continue
        out.append((top, mod))
        path = getattr(mod, "__path__", None)
        if not path:
            continue
        subs = []
        try:
            for info in pkgutil.walk_packages(path, top + ".", onerror=lambda _n: None):
                subs.append(info.name)
        except BaseException:
            pass
        for sub in sorted(set(subs)):
            if denied(sub) or any(p.startswith("_") for p in sub.split(".")[1:]):
                continue
            m = safe_import(sub)
            if m is not None:
                out.append((sub, m))
    return out

def doc_of(obj):
    try:
        d = inspect.getdoc(obj)
    except BaseException:
        return None
    return d if isinstance(d, str) else None

docs = []
def add(d):
    if d and len(d.strip()) >= min_chars:
        docs.append(d.strip())

for name, mod in module_names():
    add(doc_of(mod))
    try:
        members = sorted(vars(mod).items())
    except BaseException:
        continue
    for attr, obj in members:
        owner = getattr(obj, "__module__", None)
        # defined here, or in a private C/pure-Python twin that is not walked itself (io -> _io)
        if attr.startswith("_") or not isinstance(owner, str) or (
            owner != name and not owner.split(".")[-1].startswith("_")
        ):
            continue
        if inspect.isclass(obj):
            add(doc_of(obj))
            try:
                cmembers = sorted(vars(obj).items())
            except BaseException:
                continue
            for cattr, cobj in cmembers:
                if cattr.startswith("_"):
                    continue
                if isinstance(cobj, (staticmethod, classmethod)):
                    cobj = cobj.__func__
                if inspect.isroutine(cobj) or isinstance(cobj, property):
                    add(doc_of(cobj))
        elif inspect.isroutine(obj):
            add(doc_of(obj))

seen = set(); unique = []
for d in docs:
    if d not in seen:
        seen.add(d); unique.append(d)
real_stdout.write("\n@@LOOPLM_STDLIB_DOCS@@" + json.dumps(unique) + "\n")
real_stdout.flush()
"""

_MARKER = "@@LOOPLM_STDLIB_DOCS@@"
_CACHE: dict[tuple, list[str]] = {}


def collect_stdlib_docs(min_chars: int = 40, timeout: float = 300.0) -> list[str]:
    """Return the standard-library docstring corpus (a list of documents, deterministic order).

    Runs the collection in a child interpreter (``sys.executable -I -S``) and caches the result in
    memory. Takes a few seconds on first call.

    Raises:
        RuntimeError: the child interpreter failed or produced no documents.
    """
    key = (sys.executable, min_chars)
    if key in _CACHE:
        return _CACHE[key]
    cfg = {"deny": sorted(STDLIB_DENYLIST), "deny_parts": sorted(_DENIED_PARTS), "min_chars": min_chars}
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD_CODE, json.dumps(cfg)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(
            f"collecting the stdlib docstring corpus took more than {timeout:.0f}s; "
            "use a files source (data.source: files) instead"
        ) from e
    idx = proc.stdout.rfind(_MARKER)
    if proc.returncode != 0 or idx < 0:
        tail = (proc.stderr or "")[-2000:]
        raise RuntimeError(
            f"collecting the stdlib docstring corpus failed (exit code {proc.returncode}) "
            f"with {sys.executable}:\n{tail}"
        )
    docs = json.loads(proc.stdout[idx + len(_MARKER) :].strip())
    if not docs:
        raise RuntimeError("the stdlib docstring corpus came out empty; use a files source instead")
    _CACHE[key] = docs
    return docs
