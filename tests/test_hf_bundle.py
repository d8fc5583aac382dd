"""The self-contained export: looplm's model code carried flat into the export directory, loading and
generating where looplm is not installed, for every registered rule, with looplm's logits."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ast
import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import looplm
from looplm import dispatch
from looplm.hf.bundle import NOT_CARRIED, BundleError, build_bundle, export_name, package_dir
from looplm.hf.export import export_hf
from looplm.recurrence import RULES

from test_hf_export import _perturb, _prompt, _rule_configs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bundle_carries_the_model_code_and_nothing_else():
    b = build_bundle(version="test")
    mods = set(b.modules)
    # the model: config, helpers, caches, dispatch, layers, blocks, every rule, driver, pause, factory, generate
    for m in (
        "looplm.config",
        "looplm.dataclass_util",
        "looplm.context",
        "looplm.cache",
        "looplm.dispatch",
        "looplm.blocks",
        "looplm.model",
        "looplm.pause",
        "looplm.factory",
        "looplm.decode.generate",
        "looplm.layers.attention",
        "looplm.layers.mamba2",
        "looplm.recurrence",
        "looplm.recurrence.base",
    ):
        assert m in mods, m
    rule_modules = {RULES[r].__module__ for r in RULES if not r.startswith("test-")}
    assert rule_modules <= mods  # every registered rule, without a list of them anywhere
    # no tool: kernels only as its stand-in, never the trainer, data, eval, hf tools or the CLI
    assert b.sources["looplm.kernels"] == "looplm.hf.remote.no_kernels"
    tools = [m for m in mods - {"looplm.kernels"} if any(m == t or m.startswith(t + ".") for t in NOT_CARRIED)]
    assert [m for m in tools if not m.startswith("looplm.hf.remote.")] == []
    assert b.modules["looplm.hf.remote.modeling_looplm"] == "modeling_looplm"
    assert set(b.files) == {n + ".py" for n in b.modules.values()} | {"looplm_manifest.py"}
    pkg = package_dir()
    for mod, name in b.modules.items():
        text = b.files[name + ".py"]
        tree = ast.parse(text)
        for node in ast.walk(tree):  # every looplm import became a flat sibling import
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1) and not (node.module or "").startswith("looplm."), (name, ast.unparse(node))
                if node.level == 0:
                    assert node.module.split(".")[0] != "looplm", (name, ast.unparse(node))
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "looplm" for a in node.names), name
        src = (pkg / Path(*b.sources[mod].split(".")[1:])).with_suffix(".py")
        src = src if src.is_file() else src.with_suffix("") / "__init__.py"
        assert len(text.splitlines()) == len(src.read_text().splitlines()), name  # line numbers kept
    # the same source gives the same files
    assert build_bundle(version="test").files == b.files
    manifest = b.files["looplm_manifest.py"]
    assert b.source_digest in manifest and all(
        f"from .{n} import" in manifest for n in b.modules.values() if n != "modeling_looplm"
    )


def _copy_source(tmp_path: Path) -> Path:
    root = tmp_path / "looplm"
    shutil.copytree(package_dir(), root, ignore=shutil.ignore_patterns("*.cpp", "*.h", "__pycache__", "*.yaml"))
    return root


def test_bundle_refuses_what_an_export_must_not_need(tmp_path):
    root = _copy_source(tmp_path)
    model = root / "model.py"
    text = model.read_text()
    model.write_text(
        text.replace(
            "from .recurrence import build_rule\n",
            "from .recurrence import build_rule\nfrom .train.metrics import log_path  # noqa\n",
        )
    )
    with pytest.raises(BundleError, match=r"looplm.train.metrics.*looplm.model"):
        build_bundle(root)
    model.write_text(text)
    blocks = root / "blocks.py"
    blocks.write_text(blocks.read_text().replace("import torch\n", "import torch\nimport numpy\n", 1))
    with pytest.raises(BundleError, match="numpy"):
        build_bundle(root)
    assert export_name("looplm.layers.attention") == "looplm_layers_attention"


def test_export_records_its_source_and_runs_on_the_installed_looplm_with_it(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = _perturb(looplm.build("tiny-coreloop"))
    out = export_hf(model, tmp_path / "x", tokenizer="byte")
    assert (out / "looplm_manifest.py").is_file() and (out / "looplm_kernels.py").is_file()
    # this process has looplm at the export's source: auto runs on it (its fast paths decode)
    auto = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert auto.looplm_implementation.name == "installed" and type(auto.looplm).__module__ == "looplm.model"
    bundled = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, looplm_code="bundled").eval()
    assert bundled.looplm_implementation.name == "bundled"
    assert (
        type(bundled.looplm).__module__.startswith("transformers_modules")
        and type(bundled.looplm).__name__ == "LoopedLM"
    )
    ids = _prompt(9)
    with torch.no_grad(), dispatch.reference_only():
        ref = model(ids).logits
        assert torch.equal(auto(ids).logits, ref) and torch.equal(bundled(ids).logits, ref)
        assert torch.equal(
            bundled.generate(ids, max_new_tokens=5, do_sample=False), model.generate(ids, max_new_tokens=5)
        )
    # a source that differs from the export's: auto takes the copy; `installed` still runs it when asked, with a warning
    moved = shutil.copytree(out, tmp_path / "other")  # a fresh directory: transformers caches modules per process
    (moved / "looplm_manifest.py").write_text(
        (moved / "looplm_manifest.py").read_text().replace("'sha256:", "'sha256:0")
    )
    other = AutoModelForCausalLM.from_pretrained(str(moved), trust_remote_code=True)
    assert other.looplm_implementation.name == "bundled"
    with pytest.warns(UserWarning, match="not the source this export was made from"):
        forced = AutoModelForCausalLM.from_pretrained(str(moved), trust_remote_code=True, looplm_code="installed")
    assert forced.looplm_implementation.name == "installed"
    with pytest.raises(ValueError, match="looplm_code must be one of"):
        AutoModelForCausalLM.from_pretrained(str(moved), trust_remote_code=True, looplm_code="mine")


# the check run where looplm cannot be imported: every export loads, gives looplm's logits and tokens
_NO_LOOPLM = r"""
import json, sys
sys.path[:0] = json.loads(sys.argv[2])  # site-packages, not processed: no .pth (the editable looplm install)
try:
    import looplm
    print(json.dumps({"error": "looplm is importable from " + str(looplm.__file__)}))
    raise SystemExit(0)
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
spec = json.loads(open(sys.argv[1]).read())
res = {}
for name, case in spec.items():
    m = AutoModelForCausalLM.from_pretrained(case["dir"], trust_remote_code=True).eval()
    exp = torch.load(case["expected"])
    ids = exp["ids"]
    with torch.no_grad():
        logits = m(ids).logits
    gen = m.generate(ids, max_new_tokens=4, do_sample=False, num_loops=case["loops"])
    # adaptive depth and speculative decoding come with the copied code too (looplm.decode.token_schedule, .exits, .speculative)
    gen_exit = m.generate(ids, max_new_tokens=4, do_sample=False, exit="convergence:0.05")
    gen_spec = m.generate(ids, max_new_tokens=4, do_sample=False, speculative={"draft_loops": 1, "k": 2})
    gen_spec_exit = m.generate(ids, max_new_tokens=4, do_sample=False,  # a draft at each token's exit (<= K - 1 loops)
                               speculative={"draft_loops": case["loops"] - 2, "k": 2, "exit": "convergence:0.05"})
    try:  # continuous depth batching (looplm.decode.depth_schedule, carried too): the same exits, rows at their own pace
        depth = torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False,
                                       exit={"criterion": "convergence", "threshold": 0.05, "schedule": "depth"}), exp["exit"])
    except ValueError as e:  # a model the depth schedule does not run (Mamba-2 layers, a rule's own slots)
        depth = "refused: " + str(e)[:60]
    try:  # the same at fixed shapes (looplm.decode.static_schedule, carried too)
        static = torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False,
                                        exit={"criterion": "convergence", "threshold": 0.05, "schedule": "static"}), exp["exit"])
    except ValueError as e:  # what the static schedule does not run (and a growing state, e.g. a history)
        static = "refused: " + str(e)[:60]
    try:  # the prompt at adaptive depth too (looplm.decode.exit_forward, carried: imported inside looplm.decode.token_schedule)
        prefill = torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False,
                                         exit={"criterion": "convergence", "threshold": 0.05, "prefill": "exit"}), exp["prefill"])
    except ValueError as e:  # what one forward does not run (a rule's own slots, the kl criterion with a coda)
        prefill = "refused: " + str(e)[:60]
    tok = AutoTokenizer.from_pretrained(case["dir"], trust_remote_code=False)
    res[name] = {"impl": m.looplm_implementation.name, "module": type(m.looplm).__module__,
                 "logits_max_abs": float((logits - exp["logits"]).abs().max()), "tokens": torch.equal(gen, exp["tokens"]),
                 "exit": torch.equal(gen_exit, exp["exit"]),
                 "speculative": torch.equal(gen_spec, exp["full"]) and torch.equal(gen_spec_exit, exp["full"]), "depth": depth,
                 "static": static, "prefill": prefill, "text": tok.decode(gen[0].tolist())}
print(json.dumps(res))
"""


def _or_refused(call):
    """``call()``, or ``None`` where the model refuses it (the export then refuses it too)."""
    try:
        return call()
    except ValueError:
        return None


def test_every_rule_loads_and_generates_without_looplm(tmp_path):
    """`import looplm` fails in the subprocess (asserted); transformers loads each export from its own files."""
    spec = {}
    for param in _rule_configs():
        rule, cfg = param.values
        torch.manual_seed(0)
        model = _perturb(looplm.build(cfg))
        out = export_hf(model, tmp_path / rule, tokenizer="byte")
        ids = _prompt(6)
        K = model.config.n_loops
        with torch.no_grad(), dispatch.reference_only():
            exp = {
                "ids": ids,
                "logits": model(ids).logits,
                "tokens": model.generate(ids, max_new_tokens=4, num_loops=K + 1),
                "exit": model.generate(ids, max_new_tokens=4, exit="convergence:0.05"),
                "prefill": _or_refused(
                    lambda: model.generate(
                        ids, max_new_tokens=4, exit={"criterion": "convergence", "threshold": 0.05, "prefill": "exit"}
                    )
                ),
                "full": model.generate(ids, max_new_tokens=4),
            }
        torch.save(exp, tmp_path / f"{rule}.pt")
        spec[rule] = {"dir": str(out), "expected": str(tmp_path / f"{rule}.pt"), "loops": K + 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LOOPLM"))}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _NO_LOOPLM, str(tmp_path / "spec.json"), json.dumps(site.getsitepackages())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in res, res
    print({rule: got["logits_max_abs"] for rule, got in res.items()})
    assert set(res) == set(spec) and len(res) >= 10
    for rule, got in res.items():
        assert got["impl"] == "bundled" and got["module"].startswith("transformers_modules"), (rule, got)
        # looplm's logits: bit for bit, but for products whose last bit depends on the weights' memory alignment
        # (MKL's gemv: the timestep rule's W @ psi differs by ~5e-7 between two copies of the same W)
        assert got["logits_max_abs"] <= 1e-5 and got["tokens"], (rule, got)
        assert got["exit"] and got["speculative"], (rule, got)  # the same per-token exits; lossless drafts
        assert got["depth"] is True or str(got["depth"]).startswith("refused"), (rule, got)
        assert got["static"] is True or str(got["static"]).startswith("refused"), (rule, got)
        assert got["prefill"] is True or str(got["prefill"]).startswith("refused"), (rule, got)
        assert isinstance(got["text"], str)
    assert sum(got["depth"] is True for got in res.values()) >= 5  # most rules run under the depth schedule
    assert sum(got["static"] is True for got in res.values()) >= 5  # and under its fixed-shape form
    assert sum(got["prefill"] is True for got in res.values()) >= 5  # and with the prompt at adaptive depth
