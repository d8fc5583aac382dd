"""Parity of looplm's Ouro / Huginn import with the original modelling code, when a user has that code.

    python benchmarks/check_public_parity.py --family ouro   --reference-code ~/models/Ouro-1.4B
    python benchmarks/check_public_parity.py --family huginn --reference-code ~/models/huginn-0125 \\
        [--checkpoint ~/models/huginn-0125] [--loops 1 4 32] [--seq-len 32] [--new-tokens 8]

``--reference-code DIR`` holds the original modelling files, as downloaded with a checkpoint
(``configuration_ouro.py`` + ``modeling_ouro.py``; ``raven_config_minimal.py`` + ``raven_modeling_minimal.py``);
they are imported from there as a package — nothing of them is part of looplm. Without ``--checkpoint`` a tiny
random model of the family (looplm's preset structure at toy widths) is written in the original format by
:func:`looplm.hf.public.export_original`, loaded by the original code (``from_pretrained``) and by
``looplm import`` (:func:`looplm.hf.public.load_public`); with ``--checkpoint`` the real weights are.

Compared (fp32, max |looplm − original|), at every ``--loops`` depth: the logits, every recurrent step's hidden
state (Ouro: its normed ``hidden_states_list``; Huginn: the core's output at each recurrence, hooked), the exit
distribution (Ouro: expected exit step and entropy from its ``gate_list``), and greedy decoding with caches
(tokens identical). Huginn's random initial state is handed to both sides (its ``input_states``); its decoding
check starts both from zeros (the original draws a fresh state per call). Left padding is not compared: the
original Huginn code ignores ``attention_mask`` (looplm's own tests cover padding against the equations).
Prints a markdown table; exits 1 if any difference exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import sys
import tempfile
from pathlib import Path

import torch

FILES = {"ouro": ("configuration_ouro", "modeling_ouro"), "huginn": ("raven_config_minimal", "raven_modeling_minimal")}
CLASSES = {"ouro": ("OuroConfig", "OuroForCausalLM"), "huginn": ("RavenConfig", "RavenForCausalLM")}


def load_reference(code_dir: Path, family: str):
    """The original config and model classes, imported from ``code_dir`` as a package (relative imports work)."""
    pkg = f"_looplm_reference_{family}"
    spec = importlib.util.spec_from_file_location(
        pkg, code_dir / "__init__.py", submodule_search_locations=[str(code_dir)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = mod
    names = FILES[family]
    missing = [n for n in names if not (code_dir / f"{n}.py").is_file()]
    if missing:
        raise SystemExit(f"--reference-code {code_dir}: no {', '.join(n + '.py' for n in missing)}")
    loaded = []
    for n in names:
        s = importlib.util.spec_from_file_location(f"{pkg}.{n}", code_dir / f"{n}.py")
        m = importlib.util.module_from_spec(s)
        sys.modules[f"{pkg}.{n}"] = m
        s.loader.exec_module(m)
        loaded.append(m)
    return getattr(loaded[0], CLASSES[family][0]), getattr(loaded[1], CLASSES[family][1]), loaded[1]


def tiny_model(family: str, seed: int = 0):
    """A random looplm model of the family's preset structure at toy widths (std 0.1: a settling recurrence)."""
    import looplm

    torch.manual_seed(seed)
    if family == "ouro":
        over = dict(
            vocab_size=272,
            d_model=64,
            n_core=3,
            n_loops=4,
            d_ff=96,
            max_seq_len=128,
            overrides={"attention.n_heads": 4, "attention.n_kv_heads": 2, "attention.head_dim": 16},
        )
        model = looplm.build("ouro-1.4b", init_std=0.1, **over)
    else:
        over = dict(
            vocab_size=272,
            d_model=64,
            n_prelude=1,
            n_core=2,
            n_loops=6,
            n_coda=1,
            d_ff=96,
            max_seq_len=128,
            overrides={
                "attention.n_heads": 4,
                "attention.n_kv_heads": 4,
                "attention.head_dim": 16,
                "rule.options.init_std": math.sqrt(2 / (5 * 64)),
            },
        )
        model = looplm.build("huginn-0125", init_std=0.1, **over)
    with torch.no_grad():  # norms and the gate away from their identity init, biases nonzero
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or ".norm" in n or n == "norm.weight":
                p.uniform_(0.8, 1.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.3)
        if family == "huginn":
            model.rule.inject.proj.weight.normal_(0.0, 0.1)
    return model.eval()


_TIED = {
    "ouro": {"lm_head.weight": "model.embed_tokens.weight"},
    "huginn": {"lm_head.weight": "transformer.wte.weight"},
}


def _transformers_5_compat(cls_model, module, family: str) -> list[str]:
    """transformers >= 5 expects ``_tied_weights_keys`` as ``{target: source}``; the releases' code has a list
    (``post_init`` fails). Set on the class for this process only; returns what was changed, for the report."""
    import transformers

    from transformers.utils import ModelOutput

    done = []
    if int(transformers.__version__.split(".")[0]) < 5:
        return done
    if isinstance(getattr(cls_model, "_tied_weights_keys", None), list):
        cls_model._tied_weights_keys = _TIED[family]
        done.append(f"{cls_model.__name__}._tied_weights_keys list -> {_TIED[family]}")
    table = getattr(module, "ROPE_INIT_FUNCTIONS", None)
    if isinstance(table, dict) and "default" not in table:  # transformers 5 dropped the plain RoPE's entry
        table["default"] = _default_rope
        done.append("ROPE_INIT_FUNCTIONS['default'] = θ^(-2i/d) (dropped in transformers 5)")
    # its own output dataclasses take past_key_values=, which transformers 5 renames to cache= (a TypeError):
    # the module's outputs become plain namespaces (the numbers are untouched)
    for name, obj in list(vars(module).items()):
        if isinstance(obj, type) and issubclass(obj, ModelOutput) and obj.__module__ == module.__name__:
            setattr(module, name, _Fields)
            done.append(f"{name}(...) -> a dict of its fields")
    return done


def _default_rope(config, device=None, *args, **kwargs):
    """Plain RoPE's ``(inv_freq, attention_scaling)`` as transformers 4 computed it (fp32, θ^(-2i/d))."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    base = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0
    )
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv, 1.0


class _Fields(dict):
    """An output record: a dict whose keys are also attributes (what ``generate`` reads from a ModelOutput)."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def original_model(cls_cfg, cls_model, path: Path):
    cfg = cls_cfg.from_pretrained(str(path))
    kw = {"dtype": torch.float32} if "dtype" in inspect.signature(cls_model.from_pretrained).parameters else {}
    try:
        m = cls_model.from_pretrained(str(path), config=cfg, attn_implementation="eager", **kw)
    except (TypeError, ValueError):
        m = cls_model.from_pretrained(str(path), config=cfg, **kw)
    return m.float().eval()


def _causal_masks(ids, windows):
    """Additive causal masks ``[B, 1, T, T]`` by layer type, handed to the original forward ready-made (its own
    mask builders call transformers' masking API, whose arguments changed in transformers 5)."""
    B, T = ids.shape
    i = torch.arange(T)
    allowed = {"full_attention": i[None, :] <= i[:, None]}
    if windows:
        allowed["sliding_attention"] = allowed["full_attention"] & (i[None, :] > i[:, None] - windows)
    neg = torch.finfo(torch.float32).min
    return {k: torch.zeros(T, T).masked_fill(~a, neg)[None, None].expand(B, 1, T, T) for k, a in allowed.items()}


def _ouro_steps(orig, ids, r):
    """(logits, per-step normed states, gate logits) of the original Ouro at ``r`` steps."""
    orig.model.total_ut_steps = r
    kw = (
        {"use_early_exit_gate": True}
        if "use_early_exit_gate" in inspect.signature(orig.model.forward).parameters
        else {}
    )
    masks = _causal_masks(ids, getattr(orig.config, "sliding_window", None))
    res = orig.model(input_ids=ids, attention_mask=masks, use_cache=False, **kw)
    states, gates = res[1], res[2]
    logits = orig.lm_head(states[-1]).float()
    return logits, states, gates


def _pdf(gates):
    remain, pdf = torch.ones_like(gates[0][..., 0]), []
    for i, g in enumerate(gates):
        lam = torch.sigmoid(g[..., 0])
        pdf.append(lam * remain if i < len(gates) - 1 else remain)
        remain = remain * (1 - lam)
    return torch.stack(pdf, -1)


def compare(family: str, ours, orig, loops, T: int, new_tokens: int, seed: int = 0) -> list[tuple[str, str, float]]:
    from looplm.recurrence.state_init import position_noise

    g = torch.Generator().manual_seed(seed)
    V = ours.config.vocab_size
    ids = torch.randint(0, min(V, 256), (2, T), generator=g)
    rows = []
    with torch.no_grad():
        for r in loops:
            if family == "ouro":
                out = ours(ids, num_loops=r, output_iterations=True)
                le, states, gates = _ouro_steps(orig, ids, r)
                rows.append(("logits", str(r), float((out.logits - le).abs().max())))
                rows.append(
                    (
                        "per-step states N(h_k)",
                        str(r),
                        max(float((ours.norm(h) - s).abs().max()) for h, s in zip(out.iterations, states)),
                    )
                )
                pdf = _pdf(gates)
                steps = torch.arange(1, r + 1, dtype=torch.float32)
                e = ours.rule.last_exit
                rows.append(
                    ("exit: expected step", str(r), float((e["expected_step"] - (pdf * steps).sum(-1)).abs().max()))
                )
                rows.append(
                    (
                        "exit: entropy",
                        str(r),
                        float((e["entropy"] + (pdf * torch.log(pdf + 1e-10)).sum(-1)).abs().max()),
                    )
                )
            else:
                pos = torch.arange(T)[None].expand(2, T)
                ro = ours.config.rule.options
                s0 = position_noise(pos, ours.config.d_model, ro.get("init_seed") or 0, ro.get("init_std", 0.0))
                s0 = s0 * ours.embed_multiplier
                caught = []
                h = orig.transformer.core_block[-1].register_forward_hook(lambda m, a, o: caught.append(o))
                try:
                    le = orig(ids, input_states=s0.clone(), num_steps=r).logits.float()
                finally:
                    h.remove()
                out = ours(ids, num_loops=r, output_iterations=True, loop_options={"initial_state": s0})
                rows.append(("logits", str(r), float((out.logits - le).abs().max())))
                rows.append(
                    (
                        "per-step states s_k",
                        str(r),
                        max(float((a - b).abs().max()) for a, b in zip(out.iterations, caught)),
                    )
                )
        # greedy decoding with caches (Huginn: both from a zero state)
        n = new_tokens
        if family == "huginn":
            import copy

            ours_z = copy.deepcopy(ours)
            ours_z.rule.init_state = "zeros"
            orig.config.init_values = {**orig.config.init_values, "std": 0.0}
            ours_dec = ours_z
        else:
            ours_dec = ours
            orig.model.total_ut_steps = ours.config.n_loops
        got = ours_dec.generate(ids, max_new_tokens=n)
        how = "cache"
        try:
            want = orig.generate(ids, max_new_tokens=n, do_sample=False, use_cache=True, min_new_tokens=n)
        except Exception as e:  # the original generate path breaks under some transformers versions
            how = f"no cache ({type(e).__name__}: {str(e)[:80]})"
            want = ids
            for _ in range(n):
                if family == "ouro":
                    logits = _ouro_steps(orig, want, ours.config.n_loops)[0]
                else:
                    logits = orig(want, num_steps=ours.config.n_loops).logits
                want = torch.cat([want, logits[:, -1:].argmax(-1)], 1)
        rows.append(
            (
                f"greedy tokens differing (original: {how})",
                str(ours.config.n_loops),
                float((got[:, -n:] != want[:, -n:]).sum()),
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["ouro", "huginn"], required=True)
    ap.add_argument("--reference-code", required=True, type=Path, help="directory of the original modelling files")
    ap.add_argument(
        "--checkpoint", type=Path, default=None, help="a real checkpoint directory (default: a tiny random one)"
    )
    ap.add_argument("--loops", type=int, nargs="*", default=None, help="depths (default: 1, 2, K, K + 2)")
    ap.add_argument("--seq-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args(argv)

    from looplm.data.tokenizers import ByteTokenizer
    from looplm.hf.public import export_original, load_public

    cls_cfg, cls_model, module = load_reference(args.reference_code.expanduser(), args.family)
    shims = _transformers_5_compat(cls_model, module, args.family)
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            src = export_original(tiny_model(args.family), Path(tmp) / "ckpt", tokenizer=ByteTokenizer())
            what = "tiny random checkpoint written by export_original"
        else:
            src, what = args.checkpoint.expanduser(), str(args.checkpoint)
        ours = load_public(src)[0]
        orig = original_model(cls_cfg, cls_model, src)
        K = ours.config.n_loops
        loops = args.loops or sorted({1, 2, K, K + 2})
        rows = compare(args.family, ours, orig, loops, args.seq_len, args.new_tokens)
    import transformers

    print(
        f"{args.family}: {what}; reference code {args.reference_code}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    for line in shims:
        print(f"  compatibility shim: {line}")
    print("\n| quantity | depth r | max abs diff |\n| --- | ---: | ---: |")
    for q, r, v in rows:
        print(f"| {q} | {r} | {v:.2e} |")
    bad = [row for row in rows if row[2] > args.tol]
    if bad:
        print(f"\n{len(bad)} row(s) above --tol {args.tol}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
