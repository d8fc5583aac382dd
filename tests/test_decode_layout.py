"""The decode package's house rules: no decoding module at the package root, imports one way down its
floors, the model's parts call into it only through ``LoopedLM.generate``, the old import paths still
work (with a warning), and an ``exit=`` / ``speculative=`` spec is checked once per call, at the entry."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import looplm
from looplm import _moved
from looplm.decode.exits import Exit
from looplm.decode.speculative import Speculative

from test_architecture import MODEL_CODE, PKG, import_graph

# the package root keeps the model's own parts, the command line and the I/O
ROOT_MODULES = {
    "__init__",
    "_moved",
    "blocks",
    "cache",
    "checkpoint_io",
    "cli",
    "config",
    "context",
    "dataclass_util",
    "dispatch",
    "factory",
    "info",
    "interop",
    "model",
    "parallel",
    "pause",
}

# looplm.decode's floors (its docstring): a module imports only modules on lower floors
FLOORS = {
    "exits": 0,
    "kv_fill": 0,
    "sampling": 0,
    "scheduler": 0,
    "exit_forward": 1,
    "token_schedule": 2,
    "depth_schedule": 3,
    "speculative": 3,
    "static_schedule": 4,
    "generate": 5,
}


def test_the_package_root_holds_no_decoding_or_bench_module():
    root = {p.stem for p in PKG.glob("*.py")}
    assert root == ROOT_MODULES, f"new root modules {sorted(root - ROOT_MODULES)}; gone {sorted(ROOT_MODULES - root)}"
    for old in _moved.MOVED:  # an old path is answered by the alias finder, never by a file
        assert not (PKG / (old.removeprefix("looplm.") + ".py")).exists(), old
    assert {p.stem for p in (PKG / "decode").glob("*.py")} == set(FLOORS) | {"__init__"}
    assert (PKG / "bench" / "__init__.py").exists() and (PKG / "bench" / "adaptive").is_dir()


def test_decode_imports_go_down_its_floors():
    graph = import_graph()
    up = {}
    for mod, floor in FLOORS.items():
        deps = {
            d.removeprefix("looplm.decode.") for d in graph[f"looplm.decode.{mod}"] if d.startswith("looplm.decode.")
        }
        bad = sorted(d for d in deps if FLOORS[d] >= floor)
        if bad:
            up[mod] = bad
    assert up == {}, f"imports up or across a floor: {up}"
    # the package itself imports nothing (importing one module does not load the others)
    assert {d for d in graph["looplm.decode"] if d.startswith("looplm.")} <= {"looplm"}


def test_the_model_calls_into_decode_only_through_generate():
    graph = import_graph()
    arrows = {
        (m, d) for m, deps in graph.items() if m.startswith(MODEL_CODE) for d in deps if d.startswith("looplm.decode")
    }
    assert arrows <= {("looplm.model", "looplm.decode"), ("looplm.model", "looplm.decode.generate")}, sorted(arrows)


def test_import_looplm_loads_no_decode_kernel_or_bench_module():
    code = (
        "import looplm, sys; print(sorted(m for m in sys.modules if m.startswith(('looplm.decode', 'looplm.kernels', "
        "'looplm.bench', 'torch._dynamo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_import_path_is_the_moved_module_with_a_deprecation_warning(old):
    code = (
        f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        f"try:\n    import {old}\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
        f"warnings.simplefilter('ignore')\nimport importlib, sys\n"
        f"print(importlib.import_module({old!r}) is importlib.import_module({_moved.MOVED[old]!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith(f"warned: {old} moved to {_moved.MOVED[old]}") and out[1] == "True", out


def test_an_old_name_as_an_attribute_and_from_import():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from looplm.adaptive_forward import adaptive_forward  # noqa: PLC0415  (the README's import before the move)

        import looplm.decode.exit_forward as new

        assert adaptive_forward is new.adaptive_forward
        assert looplm.exits is sys.modules["looplm.decode.exits"]
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        looplm.not_a_module  # noqa: B018


# ----------------------------------------------------------------------------------------------------
# one way down: the spec is checked once, at the entry, and handed down as the resolved object


@pytest.fixture
def checks(monkeypatch):
    """Counts of the spec checks that really ran (``Exit._check``, ``Speculative._check``)."""
    n = {"exit": 0, "speculative": 0}
    for key, cls in (("exit", Exit), ("speculative", Speculative)):
        orig = cls._check

        def counted(self, *a, _orig=orig, _key=key, **kw):
            n[_key] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cls, "_check", counted)
    return n


def _model():
    torch.manual_seed(0)
    return looplm.build("tiny-llama", n_loops=3).eval()


@pytest.mark.parametrize(
    "exit",
    [
        "kl:0.05",
        {"criterion": "kl", "threshold": 0.05, "schedule": "depth"},
        {"criterion": "kl", "threshold": 0.05, "schedule": "depth", "max_batch": 2},
        {"criterion": "convergence", "threshold": 0.3, "schedule": "static"},
        {"criterion": "kl", "threshold": 0.05, "prefill": "exit"},
        {"criterion": "kl", "threshold": 0.05, "schedule": "depth", "prefill": "exit"},
        {"criterion": "replay", "depths": torch.tensor([1, 2, 3]), "schedule": "depth"},
    ],
)
def test_generate_checks_an_exit_once(exit, checks):
    m = _model()
    ids = torch.randint(0, 250, (3, 5))
    out, stats = m.generate(ids, 4, exit=exit, return_stats=True)
    assert out.shape == (3, 9) and stats.summary()["tokens"] > 0
    assert checks == {"exit": 1, "speculative": 0}


def test_a_front_ends_resolved_exit_is_not_checked_again(checks):
    from looplm.decode.generate import adaptive_options

    m = _model()
    opts = adaptive_options(m, exit="kl:0.05", schedule="depth", kv="propagate")
    assert checks["exit"] == 1
    m.generate(torch.randint(0, 250, (2, 4)), 3, **opts)
    assert checks["exit"] == 1
    opts = adaptive_options(m, speculative=1, draft_k=2, draft_exit="kl:0.05")
    assert checks == {"exit": 2, "speculative": 1}  # the draft's exit, inside the speculative spec's one check
    m.generate(torch.randint(0, 250, (2, 4)), 3, **opts)
    assert checks == {"exit": 2, "speculative": 1}


def test_a_changed_exit_is_checked_again_and_another_model_too(checks):
    m, other = _model(), _model()
    e = Exit.parse("kl:0.05").resolved(m)
    assert e.resolved(m) is e and checks["exit"] == 1
    with pytest.raises(ValueError, match="kv policy 'bogus' is unknown"):
        e.with_policies(kv="bogus").resolved(m)  # a copy with a field replaced: checked anew
    assert e.resolved(other) is not e and checks["exit"] == 3
    # per-row replay depths: checked against each batch they are used with
    r = Exit(criterion="replay", depths=torch.tensor([1, 2])).resolved(m, 2)
    with pytest.raises(ValueError, match="exit depths have 2 rows, the batch has 3"):
        r.resolved(m, 3)
