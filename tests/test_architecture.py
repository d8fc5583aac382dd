"""The shape of the package, held by tests: no import circles (imports inside functions counted), the model
imports no fast path, the config and context modules are leaves, and ``import looplm`` loads no kernel."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import looplm

PKG = Path(looplm.__file__).parent
MODEL_CODE = (
    "looplm.layers",
    "looplm.blocks",
    "looplm.recurrence",
    "looplm.model",
    "looplm.context",
    "looplm.cache",
    "looplm.config",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(mod: str, path: Path, mods: dict) -> set[str]:
    """Every looplm module ``mod`` imports, at the top or inside a function (``from a import b`` counts
    ``a.b`` when that is a module, else ``a``)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                m = ".".join(base + ([node.module] if node.module else []))
            else:
                m = node.module or ""
            names = [f"{m}.{a.name}" if f"{m}.{a.name}" in mods else m for a in node.names]
        for n in names:
            while n not in mods and "." in n:
                n = n.rsplit(".", 1)[0]
            if n in mods and n != mod:
                found.add(n)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the looplm modules it imports; importing ``a.b.c`` also imports its packages ``a.b`` and ``a``."""
    mods = _modules()
    graph = {}
    for m, f in mods.items():
        deps = _imports(m, f, mods)
        for d in list(deps):
            parts = d.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in mods and not m.startswith(parent + "."):  # a package's own modules import it anyway
                    deps.add(parent)
        graph[m] = deps - {m}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert import_cycles(graph) == []


def test_the_checker_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(g) == [["a", "b", "c"]]


def test_the_model_imports_no_fast_path():
    graph = import_graph()
    offenders = {
        m: sorted(d for d in deps if d.startswith("looplm.kernels"))
        for m, deps in graph.items()
        if m.startswith(MODEL_CODE)
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_config_and_context_are_leaves():
    graph = import_graph()
    assert graph["looplm.config"] - {"looplm"} <= {"looplm.dataclass_util"}
    assert graph["looplm.context"] - {"looplm"} <= {"looplm.cache"}
    assert graph["looplm.dispatch"] - {"looplm"} == set()


def test_import_looplm_loads_no_kernel_and_no_dynamo():
    code = (
        "import looplm, sys; print(sorted(m for m in sys.modules if 'kernels' in m or m.startswith('torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def _private_model_calls(tree: ast.AST, private: set[str]) -> list[tuple[int, str]]:
    """``X._name`` where ``_name`` is one of LoopedLM's own private methods (whatever ``X`` is called)."""
    return [
        (n.lineno, n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr in private
        and not (isinstance(n.value, ast.Name) and n.value.id == "self")
    ]


def test_no_code_outside_the_model_calls_a_private_model_method():
    """decode/, serve/ and every other driver go through LoopedLM's public step API (check_inputs,
    forward_context, embed_tokens, cache_slots, loop_iteration, readout): no ``model._x`` outside model.py."""
    from looplm.model import LoopedLM

    private = {
        name for name, v in vars(LoopedLM).items() if name.startswith("_") and not name.startswith("__") and callable(v)
    }
    assert {"_embed", "_resolve_loops"} <= private  # the check is about something
    found = {}
    for mod, path in _modules().items():
        if mod == "looplm.model":
            continue
        hits = _private_model_calls(ast.parse(path.read_text()), private)
        if hits:
            found[mod] = hits
    assert not found, f"private LoopedLM methods called outside model.py: {found}"
    planted = ast.parse("def f(m):\n    return m._embed(1, False)\n")
    assert _private_model_calls(planted, private) == [(2, "_embed")]  # the checker finds one
