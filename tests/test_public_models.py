"""Ouro and Huginn in looplm (``looplm.hf.public``): tiny random checkpoints written here in each original format
(``config.json`` with their field names, safetensors with their tensor names) are imported and compared with
an independent reference forward written below from the architectures' equations (fp32) — logits, per-step
hidden states, exit distributions, cached greedy decoding, at the trained depth and others, left-padded batches;
refusals of bad configs and tensors; shards and dtypes; export back to the original format; the norm
placements, random initial states and exit-gate options the two families need; the three presets' sizes; and
``looplm import / info / generate / eval harness / analyze / train`` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import looplm
from looplm.checkpoint_io import load_model_for_inference
from looplm.cli import main as cli_main
from looplm.config import ModelConfig
from looplm.dataclass_util import ConfigError
from looplm.hf.importer import import_hf
from looplm.hf.public import PublicFormatError, _freqs_cis, export_original, family_of, load_public
from looplm.recurrence.state_init import position_noise

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = RTOL = 1e-5  # fp32, every comparison below: |looplm − reference| <= 1e-5 + 1e-5·|reference|


# ------------------------------------------------------------------------------------------------
# checkpoints in the original formats (written from scratch, with the release's names)
# ------------------------------------------------------------------------------------------------


def _write_tokenizer(d: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from looplm.hf.tokenizer import byte_backend

    fast = PreTrainedTokenizerFast(
        tokenizer_object=byte_backend(), eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(d))


def _save(d: Path, tensors: dict, dtype, shards: int) -> None:
    tensors = {k: (v if k == "freqs_cis" else v.to(dtype)).contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return
    names = sorted(tensors)
    wmap = {}
    for s in range(shards):
        f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(d / f))
        wmap |= {n: f for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def write_ouro(
    d: Path,
    *,
    V=272,
    dm=32,
    L=2,
    H=4,
    kv=2,
    hd=8,
    ff=48,
    K=3,
    tie=False,
    dtype=torch.float32,
    shards=1,
    seed=0,
    **extra,
):
    """An Ouro checkpoint directory (``modeling_ouro``'s names); returns ``(dir, config, tensors)``."""
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="ouro",
        architectures=["OuroForCausalLM"],
        vocab_size=V,
        hidden_size=dm,
        intermediate_size=ff,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=kv,
        head_dim=hd,
        hidden_act="silu",
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=tie,
        total_ut_steps=K,
        early_exit_threshold=1.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=L,
        layer_types=["full_attention"] * L,
        torch_dtype="float32",
    )
    cfg.update(extra)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": r(V, dm, std=1.0)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": r(H * hd, dm),
            p + "self_attn.k_proj.weight": r(kv * hd, dm),
            p + "self_attn.v_proj.weight": r(kv * hd, dm),
            p + "self_attn.o_proj.weight": r(dm, H * hd),
            p + "mlp.gate_proj.weight": r(ff, dm),
            p + "mlp.up_proj.weight": r(ff, dm),
            p + "mlp.down_proj.weight": r(dm, ff),
        }
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            t[p + n + ".weight"] = 1 + r(dm, std=0.1)
    t |= {
        "model.norm.weight": 1 + r(dm, std=0.1),
        "model.early_exit_gate.weight": r(1, dm, std=0.5),
        "model.early_exit_gate.bias": r(1, std=0.5),
    }
    if not tie:
        t["lm_head.weight"] = r(V, dm, std=0.1)
    _save(d, t, dtype, shards)
    (d / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(d)
    return d, cfg, {k: v.to(dtype).float() for k, v in t.items()}


def write_huginn(
    d: Path,
    *,
    V=272,
    dm=32,
    H=4,
    ff=48,
    p=1,
    s=2,
    c=1,
    K=4,
    tie=True,
    qk_bias=True,
    dtype=torch.float32,
    shards=1,
    seed=0,
    **extra,
):
    """A Huginn / Raven checkpoint directory (``raven_modeling_minimal``'s names, ``freqs_cis`` included)."""
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    hd, std = dm // H, math.sqrt(2 / (5 * dm))
    cfg = dict(
        model_type="huginn_raven",
        architectures=["RavenForCausalLM"],
        n_embd=dm,
        num_attention_heads=H,
        num_key_value_heads=H,
        intermediate_size=ff,
        vocab_size=V,
        padded_vocab_size=V,
        n_layers=p + s + c,
        n_layers_in_prelude=p,
        n_layers_in_recurrent_block=s,
        n_layers_in_coda=c,
        mean_recurrence=K,
        mean_backprop_depth=2,
        injection_type="linear",
        state_init="like-init",
        norm_eps=1e-6,
        qk_bias=qk_bias,
        bias=False,
        tie_embeddings=tie,
        rope_base=50000,
        block_size=64,
        block_class_name="SandwichBlock",
        norm_class_name="RMSNorm_llama",
        mlp_class_name="GatedMLP",
        nonlin_name="SiLU",
        init_values={"std": std, "out_proj": std, "embedding": std, "embed_scale": math.sqrt(dm)},
    )
    cfg.update(extra)

    def r(*shape, std=0.1):  # gains below 1: a recurrence that settles, as a trained one does (fp32 stays exact)
        return torch.randn(*shape, generator=g) * std

    t = {"transformer.wte.weight": r(V, dm, std=0.1)}
    for part, n in (("prelude", p), ("core_block", s), ("coda", c)):
        for i in range(n):
            q = f"transformer.{part}.{i}."
            t |= {
                q + "attn.Wqkv.weight": r(3 * dm, dm),
                q + "attn.proj.weight": r(dm, dm),
                q + "mlp.fc.weight": r(2 * ff, dm),
                q + "mlp.proj.weight": r(dm, ff),
            }
            if qk_bias:
                t[q + "attn.qk_bias"] = r(2, 1, H, hd, std=0.3)
            for k in range(1, 5):
                t[q + f"norm_{k}.weight"] = 1 + r(dm, std=0.1)
    t |= {"transformer.adapter.weight": r(dm, 2 * dm), "transformer.ln_f.weight": 1 + r(dm, std=0.1)}
    if not tie:
        t["lm_head.weight"] = r(V, dm, std=0.1)
    # the persistent RoPE buffer of the release (not a weight), in fp32 as looplm computes it
    t["freqs_cis"] = _freqs_cis(hd, cfg["block_size"], cfg["rope_base"])
    _save(d, t, dtype, shards)
    (d / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(d)
    return d, cfg, {k: v.to(dtype).float() for k, v in t.items() if k != "freqs_cis"}


# ------------------------------------------------------------------------------------------------
# the reference: the equations, on the original tensors (fused Wqkv, interleaved RoPE, ...)
# ------------------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _positions_and_allowed(mask):
    """Left padding: positions count real tokens; a query sees real keys at or before it (and itself)."""
    T = mask.shape[1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    return pos, allowed | torch.eye(T, dtype=torch.bool)[None]


def _attend(q, k, v, allowed):
    """softmax(q kᵀ/√hd) v over allowed keys; ``q [B, H, T, hd]``, ``k, v [B, H_kv, T, hd]`` (GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed[:, None], float("-inf"))
    return s.softmax(-1) @ v


def _angles(pos, hd, theta):
    """cos, sin of ``t · θ^(−2i/hd)`` in the releases' arithmetic (fp32: it matters at long positions)."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos[:, None, :, None].float() * inv  # [B, 1, T, hd/2]
    return ang.cos(), ang.sin()


def _rope_half(x, pos, theta):  # Ouro (Llama): channel i pairs with i + hd/2
    c, s = _angles(pos, x.shape[-1], theta)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _rope_pairs(x, pos, theta):  # Huginn: (2i, 2i+1) rotated as the complex number x_2i + i·x_2i+1
    c, s = _angles(pos, x.shape[-1], theta)
    re, im = x[..., 0::2], x[..., 1::2]
    return torch.stack([re * c - im * s, im * c + re * s], -1).flatten(-2)


def ouro_reference(t, cfg, ids, mask=None, K=None, windows=None, offset=0):
    """Ouro: ``h_k = N(F(h_{k−1}))`` with sandwich layers; returns logits of the last step, the per-step normed
    states, the exit pdf ``[B, T, K]`` and every step's logits. ``windows``: ``{layer: w}`` sliding windows;
    ``offset``: the first token's position."""
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask
    pos, allowed = _positions_and_allowed(mask)
    pos = pos + offset
    idx = torch.arange(T)
    band = {i: allowed & (idx[None, :] > idx[:, None] - w)[None] for i, w in (windows or {}).items()}
    L, H, kv, hd, eps = (
        cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")
    )
    K = K or cfg["total_ut_steps"]
    h = t["model.embed_tokens.weight"][ids]
    states, lams = [], []
    for _ in range(K):
        for i in range(L):
            p = f"model.layers.{i}."
            u = _rms(h, t[p + "input_layernorm.weight"], eps)
            q = (u @ t[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
            k = (u @ t[p + "self_attn.k_proj.weight"].T).view(B, T, kv, hd).transpose(1, 2)
            v = (u @ t[p + "self_attn.v_proj.weight"].T).view(B, T, kv, hd).transpose(1, 2)
            q, k = _rope_half(q, pos, cfg["rope_theta"]), _rope_half(k, pos, cfg["rope_theta"])
            a = (
                _attend(q, k, v, band.get(i, allowed)).transpose(1, 2).reshape(B, T, H * hd)
                @ t[p + "self_attn.o_proj.weight"].T
            )
            h = h + _rms(a, t[p + "input_layernorm_2.weight"], eps)
            u = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
            m = (F.silu(u @ t[p + "mlp.gate_proj.weight"].T) * (u @ t[p + "mlp.up_proj.weight"].T)) @ t[
                p + "mlp.down_proj.weight"
            ].T
            h = h + _rms(m, t[p + "post_attention_layernorm_2.weight"], eps)
        h = _rms(h, t["model.norm.weight"], eps)  # the final norm ends every recurrent step
        states.append(h)
        lams.append(torch.sigmoid(h @ t["model.early_exit_gate.weight"].T + t["model.early_exit_gate.bias"])[..., 0])
    remain, pdf = torch.ones(B, T), []
    for k, lam in enumerate(lams):
        pdf.append(lam * remain if k < K - 1 else remain)
        remain = remain * (1 - lam)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    step_logits = [s @ head.T for s in states]
    return step_logits[-1], states, torch.stack(pdf, -1), step_logits


def huginn_reference(t, cfg, ids, s0, mask=None, r=None, offset=0):
    """Huginn: prelude, ``s_k = core(adapter([s_{k−1}; e]))`` from ``s0``, ``ln_f``, coda, ``ln_f``, tied head;
    returns the logits and every ``s_k``."""
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask
    pos, allowed = _positions_and_allowed(mask)
    pos = pos + offset
    d, H, eps, theta = cfg["n_embd"], cfg["num_attention_heads"], cfg["norm_eps"], cfg["rope_base"]
    hd = d // H
    r = r or cfg["mean_recurrence"]

    def block(x, p):  # post-sum ("SandwichBlock"): the residual stream is normalised after each sum
        q, k, v = (_rms(x, t[p + "norm_1.weight"], eps) @ t[p + "attn.Wqkv.weight"].T).split([d, d, d], -1)
        q, k, v = q.view(B, T, H, hd), k.view(B, T, H, hd), v.view(B, T, H, hd)
        if cfg["qk_bias"]:
            q, k = q + t[p + "attn.qk_bias"][0], k + t[p + "attn.qk_bias"][1]
        q, k = _rope_pairs(q.transpose(1, 2), pos, theta), _rope_pairs(k.transpose(1, 2), pos, theta)
        a = _attend(q, k, v.transpose(1, 2), allowed).transpose(1, 2).reshape(B, T, d) @ t[p + "attn.proj.weight"].T
        x = _rms(a + x, t[p + "norm_2.weight"], eps)
        g, up = (_rms(x, t[p + "norm_3.weight"], eps) @ t[p + "mlp.fc.weight"].T).chunk(2, -1)
        return _rms((F.silu(g) * up) @ t[p + "mlp.proj.weight"].T + x, t[p + "norm_4.weight"], eps)

    e = t["transformer.wte.weight"][ids] * cfg["init_values"]["embed_scale"]
    for i in range(cfg["n_layers_in_prelude"]):
        e = block(e, f"transformer.prelude.{i}.")
    s, states = s0, []
    for _ in range(r):
        s = torch.cat([s, e], -1) @ t["transformer.adapter.weight"].T
        for i in range(cfg["n_layers_in_recurrent_block"]):
            s = block(s, f"transformer.core_block.{i}.")
        states.append(s)
    y = _rms(s, t["transformer.ln_f.weight"], eps)
    for i in range(cfg["n_layers_in_coda"]):
        y = block(y, f"transformer.coda.{i}.")
    y = _rms(y, t["transformer.ln_f.weight"], eps)
    return y @ t.get("lm_head.weight", t["transformer.wte.weight"]).T, states


def huginn_s0(cfg, ids, mask=None, seed=0):
    """The initial state looplm draws for these tokens by default: ``γ · TN(0, σ²)`` at the tokens' positions."""
    mask = torch.ones_like(ids) if mask is None else mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return position_noise(pos, cfg["n_embd"], seed, cfg["init_values"]["std"]) * cfg["init_values"]["embed_scale"]


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------
# fixtures: one imported checkpoint of each family (module scope)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ouro(tmp_path_factory):
    root = tmp_path_factory.mktemp("ouro")
    src, cfg, t = write_ouro(root / "src")
    out = import_hf(src, root / "run")
    model, tok = load_model_for_inference(out)
    return dict(src=src, cfg=cfg, t=t, out=out, model=model, tok=tok)


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    root = tmp_path_factory.mktemp("huginn")
    src, cfg, t = write_huginn(root / "src")
    out = import_hf(src, root / "run")
    model, tok = load_model_for_inference(out)
    return dict(src=src, cfg=cfg, t=t, out=out, model=model, tok=tok)


def _padded_batch(V, gen):
    ids = torch.randint(0, V, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids, mask


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 2, 3, 5])  # trained K = 3, fewer and more
def test_ouro_logits_states_and_exit_distribution_match_the_equations(ouro, r):
    m, cfg, t = ouro["model"], ouro["cfg"], ouro["t"]
    ids, mask = _padded_batch(cfg["vocab_size"], torch.Generator().manual_seed(r))
    with torch.no_grad():
        out = m(ids, attention_mask=mask, num_loops=r, output_iterations=True)
        exit_ = m.rule.last_exit
    logits, states, pdf, _ = ouro_reference(t, cfg, ids, mask, K=r)
    real = mask.bool()
    _close(out.logits[real], logits[real], f"logits at r={r}")
    for k, (h, ref) in enumerate(zip(out.iterations, states)):
        _close(m.norm(h)[real], ref[real], f"normed state of step {k + 1}")  # Ouro's hidden_states_list
    steps = torch.arange(1, r + 1, dtype=torch.float32)
    _close(exit_["expected_step"][real], (pdf * steps).sum(-1)[real], "expected exit step Σ k p_k")
    _close(exit_["entropy"][real], -(pdf * torch.log(pdf + 1e-10)).sum(-1)[real], "exit entropy")


@pytest.mark.parametrize("q", [0.3, 0.6, 0.9])
def test_ouro_exit_threshold_selects_the_reference_step(ouro, q):
    """``exit_threshold`` q: the first step whose cumulative exit probability reaches q (its logits); the
    checkpoint's own ``early_exit_threshold`` is the rule's default."""
    m, cfg, t = ouro["model"], ouro["cfg"], ouro["t"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = m(ids, loop_options={"exit_threshold": q}).logits
        depth = m.rule.last_exit["selected_depth"]
    _, _, pdf, step_logits = ouro_reference(t, cfg, ids)
    cdf = pdf.cumsum(-1)
    assert ((cdf - q).abs() > 1e-4).all(), "a CDF value too close to q for a float-exact choice"
    want_depth = (cdf >= q).float().argmax(-1) + 1
    assert torch.equal(depth, want_depth) and len(set(depth.flatten().tolist())) > 1
    want = torch.stack(step_logits, 2).gather(2, (want_depth - 1)[..., None, None].expand(-1, -1, 1, got.shape[-1]))[
        :, :, 0
    ]
    _close(got, want, f"selected logits at q={q}")


@pytest.mark.parametrize("r", [1, 2, 4, 6])  # trained mean_recurrence 4
def test_huginn_logits_and_states_match_the_equations(huginn, r):
    m, cfg, t = huginn["model"], huginn["cfg"], huginn["t"]
    ids, mask = _padded_batch(cfg["vocab_size"], torch.Generator().manual_seed(r))
    with torch.no_grad():
        out = m(ids, attention_mask=mask, num_loops=r, output_iterations=True)
    logits, states = huginn_reference(t, cfg, ids, huginn_s0(cfg, ids, mask), mask, r=r)
    real = mask.bool()
    _close(out.logits[real], logits[real], f"logits at r={r}")
    for k, (h, ref) in enumerate(zip(out.iterations, states)):
        _close(h[real], ref[real], f"state after recurrence {k + 1}")
    if r != cfg["mean_recurrence"]:  # the depth matters: not a recurrence that has already stopped moving
        with torch.no_grad():
            assert (m(ids, attention_mask=mask).logits - out.logits)[real].abs().max() > 1e-2


def test_huginn_given_initial_state_and_zero_state(huginn, tmp_path):
    """Any initial state (``loop_options={"initial_state": s0}``, Huginn's ``input_states``) gives the
    reference from that state; ``state_init: zero`` starts from zeros."""
    m, cfg, t = huginn["model"], huginn["cfg"], huginn["t"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
    s0 = torch.randn(2, 7, cfg["n_embd"]) * 2.0
    with torch.no_grad():
        got = m(ids, loop_options={"initial_state": s0}).logits
    _close(got, huginn_reference(t, cfg, ids, s0)[0], "logits from a given initial state")
    with pytest.raises(ValueError, match=r"initial_state.*\(2, 7, 32\)"):
        m(ids, loop_options={"initial_state": s0[:, :3]})
    src, cfg0, t0 = write_huginn(tmp_path / "z", state_init="zero", seed=1)
    mz, _, _ = load_public(src)
    assert mz.config.rule.options["init_state"] == "zeros"
    with torch.no_grad():
        _close(mz(ids).logits, huginn_reference(t0, cfg0, ids, torch.zeros(2, 7, cfg0["n_embd"]))[0], "zero state")


def _greedy_reference(forward, ids, mask, n):
    """Greedy decoding by recomputing the whole (left-padded) sequence each step (no cache)."""
    for _ in range(n):
        nxt = forward(ids, mask)[:, -1].argmax(-1, keepdim=True)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_cached_greedy_decoding_matches_the_reference(family, ouro, huginn):
    """``generate`` (per-(loop, layer) KV caches, a left-padded batch) decodes the reference's tokens, and a
    cached decode's logits equal the full forward's (Huginn's random state is a function of the position)."""
    f = ouro if family == "ouro" else huginn
    m, cfg, t = f["model"], f["cfg"], f["t"]
    ids, mask = _padded_batch(cfg["vocab_size"], torch.Generator().manual_seed(11))
    if family == "ouro":
        ref = lambda x, mk: ouro_reference(t, cfg, x, mk)[0]  # noqa: E731
    else:
        ref = lambda x, mk: huginn_reference(t, cfg, x, huginn_s0(cfg, x, mk), mk)[0]  # noqa: E731
    with torch.no_grad():
        got = m.generate(ids, max_new_tokens=6, attention_mask=mask)  # greedy
        want = _greedy_reference(ref, ids, mask, 6)
    assert torch.equal(got[:, -6:], want[:, -6:])
    from helpers import assert_cached_equals_full

    assert_cached_equals_full(m, atol=1e-5)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_long_positions_use_the_releases_rope_arithmetic(family, tmp_path):
    """At position ~4,000 the fp32 arithmetic of the releases' inverse frequencies matters (an ulp per
    frequency, ~2e-4 rad): the import computes them as the original code does (``rope_precision: fp32``)."""
    if family == "ouro":
        src, cfg, t = write_ouro(tmp_path / "o", max_position_embeddings=8192)
    else:
        src, cfg, t = write_huginn(tmp_path / "h", block_size=8192)
    m, _, _ = load_public(src)
    assert m.config.attention.rope_precision == "fp32"
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(4090, 4102)[None].expand(2, 12)
    if family == "ouro":
        want = ouro_reference(t, cfg, ids, offset=4090)[0]
    else:
        s0 = position_noise(pos, cfg["n_embd"], 0, cfg["init_values"]["std"]) * cfg["init_values"]["embed_scale"]
        want = huginn_reference(t, cfg, ids, s0, offset=4090)[0]
    with torch.no_grad():
        _close(m(ids, position_ids=pos).logits, want, "logits at positions 4090..4101")
    # at the real head dims the two arithmetics differ in a third of the frequencies (the option is not cosmetic)
    from looplm.layers.rope import rope_inv_freq

    for hd, theta in ((128, 1e6), (96, 5e4)):  # Ouro, Huginn
        release = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        assert torch.equal(rope_inv_freq(hd, theta, precision="fp32"), release)
        fp64 = rope_inv_freq(hd, theta)
        assert (fp64 != release).sum() > hd // 8 and (4095 * (fp64 - release)).abs().max() > 1e-4  # radians


def test_sliding_window_layers_match_the_reference(tmp_path):
    """Ouro's ``use_sliding_window`` / ``layer_types``: the listed layers attend to their last ``w`` positions."""
    src, cfg, t = write_ouro(
        tmp_path / "sw",
        L=3,
        use_sliding_window=True,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )
    m, _, _ = load_public(src)
    assert m.config.attention.sliding_window == 3 and m.config.attention.sliding_layer_idx == [1, 2]
    assert [b.mixer.sliding_window for b in m.core.stack.blocks] == [None, 3, 3]
    ids, mask = _padded_batch(cfg["vocab_size"], torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = m(ids, attention_mask=mask).logits
    real = mask.bool()
    _close(
        got[real], ouro_reference(t, cfg, ids, mask, windows={1: 3, 2: 3})[0][real], "logits with sliding-window layers"
    )
    full, _, _ = load_public(write_ouro(tmp_path / "full", L=3)[0])
    assert not torch.allclose(full(ids, attention_mask=mask).logits[real], got[real])  # the window matters here
    from helpers import assert_cached_equals_full

    assert_cached_equals_full(m, T=12, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# formats: shards, dtypes, tied / untied heads, tokenizer, refusals
# ------------------------------------------------------------------------------------------------


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_shards_bf16_and_heads_load_the_same_weights(family, tmp_path):
    write = write_ouro if family == "ouro" else write_huginn
    one, _ = load_public(write(tmp_path / "one")[0])[:2]
    sharded, _ = load_public(write(tmp_path / "sharded", shards=3)[0])[:2]
    assert all(torch.equal(a, b) for a, b in zip(_state(one).values(), _state(sharded).values()))
    # a stray safetensors file the index does not name is not read (a warning names it)
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "sharded" / "extra.safetensors"))
    with pytest.warns(UserWarning, match=r"ignoring \['extra.safetensors'\]"):
        again, _ = load_public(tmp_path / "sharded")[:2]
    assert all(torch.equal(a, b) for a, b in zip(_state(one).values(), _state(again).values()))
    # bf16 weights: the bf16 values, in fp32 by default or kept in bf16
    src16, _, t16 = write(tmp_path / "bf16", dtype=torch.bfloat16)
    m32, _ = load_public(src16)[:2]
    m16, _ = load_public(src16, dtype=torch.bfloat16)[:2]
    emb = "model.embed_tokens.weight" if family == "ouro" else "transformer.wte.weight"
    assert m32.embed.weight.dtype == torch.float32 and torch.equal(m32.embed.weight, t16[emb])
    assert m16.embed.weight.dtype == torch.bfloat16 and torch.equal(m16.embed.weight.float(), t16[emb])
    # the other head: Ouro tied (no lm_head in the file), Huginn untied (its own lm_head)
    tie = family == "ouro"
    src, cfg, t = write(tmp_path / "head", tie=tie)
    m, _ = load_public(src)[:2]
    assert m.config.tie_embeddings == tie and (m.lm_head.weight is m.embed.weight) == tie
    ids = torch.randint(0, cfg["vocab_size"], (1, 6))
    with torch.no_grad():
        want = (
            ouro_reference(t, cfg, ids)[0]
            if family == "ouro"
            else huginn_reference(t, cfg, ids, huginn_s0(cfg, ids))[0]
        )
        _close(m(ids).logits, want, "the other head")


def test_tokenizer_and_architecture_are_recorded(ouro, huginn, capsys):
    from transformers import PreTrainedTokenizerFast

    for f, name in ((ouro, "ouro"), (huginn, "huginn")):
        out = Path(f["out"])
        assert f["model"].config.name == name
        assert (out / "model.yaml").read_text().startswith(f"name: {name}\n")
        rec = json.loads((out / "config.json").read_text())
        assert rec["import"]["imported_kind"] in ("ouro", "huginn_raven")
        src_tok = PreTrainedTokenizerFast.from_pretrained(str(f["src"]))
        text = "Loops loop, the loop loops."
        assert f["tok"].encode(text) == src_tok.encode(text, add_special_tokens=False)
        copied = PreTrainedTokenizerFast.from_pretrained(str(out / "tokenizer"))
        msgs = [{"role": "user", "content": "hi"}]
        assert copied.apply_chat_template(msgs, tokenize=False) == src_tok.apply_chat_template(msgs, tokenize=False)
        assert cli_main(["info", str(out)]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"{name}: ") and "imported from" in shown and f"{f['model'].num_params():,}" in shown


def _refused(src, *patterns, out=None):
    with pytest.raises((ValueError, OSError)) as e:  # PublicFormatError (config), ValueError / OSError (files)
        import_hf(src, out or (Path(src).parent / (Path(src).name + "-out")))
    for p in patterns:
        assert p in str(e.value), (p, str(e.value))
    if out is None:
        assert not (Path(src).parent / (Path(src).name + "-out")).exists()  # nothing written
    return str(e.value)


def test_bad_configs_are_refused_naming_every_field(tmp_path):
    src, cfg, _ = write_ouro(tmp_path / "o")
    bad = {k: v for k, v in cfg.items() if k not in ("total_ut_steps", "hidden_size")}
    (src / "config.json").write_text(json.dumps(bad))
    msg = _refused(src, "'total_ut_steps'", "'hidden_size'")
    assert "2 problem(s)" in msg
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu", "early_exit_threshold": 1.5}))
    _refused(src, "hidden_act 'gelu'", "early_exit_threshold must be a number in [0, 1]")
    (src / "config.json").write_text(
        json.dumps({**cfg, "num_hidden_layers": "two", "rope_theta": None, "rms_norm_eps": "small"})
    )
    _refused(
        src, "num_hidden_layers must be a non-negative integer, got 'two'", "rms_norm_eps must be a number, got 'small'"
    )
    src, cfg, _ = write_huginn(tmp_path / "h")
    (src / "config.json").write_text(
        json.dumps(
            {**cfg, "test_time_noise": 0.2, "injection_type": "add", "bias": True, "state_init": "embed", "n_layers": 9}
        )
    )
    _refused(src, "test_time_noise=0.2", "injection_type 'add'", "bias=true", "state_init 'embed'", "n_layers=9")
    (src / "config.json").write_text(json.dumps({**cfg, "init_values": {**cfg["init_values"], "embed_scale": 3.0}}))
    _refused(src, "embed_scale=3.0 is neither 1 nor sqrt(n_embd)")
    (src / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json' is not valid JSON"):
        import_hf(src, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_missing_unexpected_and_misshaped_tensors_are_listed_together(tmp_path):
    src, cfg, t = write_ouro(tmp_path / "o")
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.1.input_layernorm_2.weight"], sd["model.early_exit_gate.bias"]
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(sd, str(src / "model.safetensors"))
    _refused(
        src,
        "do not fit its Ouro config",
        "missing 2: model.early_exit_gate.bias, model.layers.1.input_layernorm_2.weight",
        "unexpected 1: model.layers.0.self_attn.q_norm.weight",
        "mis-shaped 1: model.layers.0.self_attn.k_proj.weight [3, 32] (expected [16, 32])",
        "nothing was written",
    )
    # a tied head that is not the embedding
    src, cfg, t = write_huginn(tmp_path / "h")
    sd = load_file(str(src / "model.safetensors"))
    sd["lm_head.weight"] = torch.randn_like(sd["transformer.wte.weight"])
    save_file(sd, str(src / "model.safetensors"))
    _refused(src, "ties the head to 'transformer.wte.weight', but 'lm_head.weight' holds other values")


def test_weight_files_are_read_exactly_as_the_format_names_them(tmp_path):
    """The shared reader (:mod:`looplm.hf.weights`): the shards of the index, or model.safetensors; a missing
    shard, both layouts at once, only other names, only pickles — each refused naming the files."""
    src, _, _ = write_huginn(tmp_path / "h", shards=2)
    shard = sorted(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (src / shard).rename(src / "elsewhere.safetensors")
    _refused(src, "lists shard(s) that are missing", shard)
    (src / "elsewhere.safetensors").rename(src / shard)
    save_file({"x": torch.zeros(1)}, str(src / "model.safetensors"))
    _refused(src, "holds both model.safetensors and model.safetensors.index.json")
    src, _, _ = write_ouro(tmp_path / "o")
    (src / "model.safetensors").rename(src / "weights.safetensors")
    (src / "other.safetensors").write_bytes((src / "weights.safetensors").read_bytes())
    _refused(
        src, "has no model.safetensors nor model.safetensors.index.json", "other.safetensors", "weights.safetensors"
    )
    for f in src.glob("*.safetensors"):
        f.unlink()
    torch.save({}, src / "pytorch_model.bin")
    _refused(src, "has no model.safetensors nor model.safetensors.index.json")


# ------------------------------------------------------------------------------------------------
# export: as any looplm model, and back into the original format
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_export_round_trips(family, ouro, huginn, tmp_path):
    f = ouro if family == "ouro" else huginn
    m, cfg, t = f["model"], f["cfg"], f["t"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = m(ids).logits
    # the original format: same config fields and tensors as the source, and an import gives the same model
    orig = export_original(f["out"], tmp_path / "orig")
    written = load_file(str(orig / "model.safetensors"))
    for k, v in t.items():
        assert torch.equal(written[k].float(), v), k
    assert set(written) - set(t) <= {"freqs_cis"}
    back = json.loads((orig / "config.json").read_text())
    for k in (
        "model_type",
        "total_ut_steps",
        "num_hidden_layers",
        "n_layers_in_recurrent_block",
        "mean_recurrence",
        "rope_theta",
        "rope_base",
        "qk_bias",
        "tie_word_embeddings",
        "tie_embeddings",
    ):
        if k in cfg:
            assert back[k] == cfg[k], k
    again, _, _ = load_public(orig)
    assert family_of(again.config) == ("ouro" if family == "ouro" else "huginn_raven")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    if family == "huginn":  # its RoPE buffer, as the release computes it
        hd = cfg["n_embd"] // cfg["num_attention_heads"]
        inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(64, dtype=torch.float32), inv)
        assert torch.equal(written["freqs_cis"], torch.stack([ang.cos(), ang.sin()], -1)[None, :, None])
    # the looplm export works like any model's
    from looplm.hf.export import export_hf
    from looplm.hf.importer import read_export

    hf = export_hf(f["out"], tmp_path / "hf")
    rm, _ = read_export(hf)
    with torch.no_grad():
        assert torch.equal(rm(ids).logits, want)
    # the command line
    assert cli_main(["export", "hf", str(f["out"]), str(tmp_path / "cli"), "--format", "original"]) == 0
    assert load_file(str(tmp_path / "cli" / "model.safetensors")).keys() == written.keys()


def test_export_original_with_reference_code_writes_the_auto_map(ouro, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "modeling_ouro.py").write_text("# the release's modelling file (a stand-in)\n")
    with pytest.raises(FileNotFoundError, match=r"lacks \['configuration_ouro.py'\]"):
        export_original(ouro["out"], tmp_path / "none", reference_code=code)
    assert not (tmp_path / "none").exists()  # refused before anything was written
    (code / "configuration_ouro.py").write_text("# stand-in\n")
    out = export_original(ouro["out"], tmp_path / "with", reference_code=code)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    }
    assert (out / "modeling_ouro.py").read_text().startswith("# the release's")


def test_export_original_refuses_other_architectures(tmp_path):
    from looplm.data.tokenizers import ByteTokenizer

    with pytest.raises(
        PublicFormatError,
        match=r"(?s)cannot be written.*as Ouro it needs norm_placement: sandwich \(is pre\).*"
        r"as Huginn it needs norm_placement: post-sum \(is pre\)",
    ):
        export_original(looplm.build("tiny-llama"), tmp_path / "x", tokenizer=ByteTokenizer())
    assert family_of(looplm.build("ouro-1.4b", device="meta").config) == "ouro"
    assert family_of(looplm.build("huginn-0125", device="meta").config) == "huginn_raven"


# ------------------------------------------------------------------------------------------------
# presets and the general options
# ------------------------------------------------------------------------------------------------


def test_preset_sizes():
    """Exact counts on the meta device (the model cards print 1.4B, 2.6B and 3.5B)."""
    sizes = {n: looplm.build(n, device="meta").num_params() for n in ("ouro-1.4b", "ouro-2.6b", "huginn-0125")}
    assert sizes == {"ouro-1.4b": 1_434_652_673, "ouro-2.6b": 2_667_974_657, "huginn-0125": 3_564_976_800}
    assert [round(sizes[n] / 1e9, 1) for n in sizes] == [1.4, 2.7, 3.6]  # the cards round down: 1.4B, 2.6B, 3.5B
    # by hand: Ouro layer = 4d² attention + 3·d·ff MLP + 4d norms; embeddings + untied head + final norm + gate (d + 1)
    d, ff, V = 2048, 5632, 49152
    layer = 4 * d * d + 3 * d * ff + 4 * d
    assert sizes["ouro-1.4b"] == 24 * layer + 2 * V * d + d + d + 1
    # Huginn block = Wqkv 3d² + q/k biases 2d + proj d² + fc 2·d·ff + proj d·ff + 4d norms; tied; adapter 2d²; ln_f
    d, ff, V = 5280, 17920, 65536
    block = 3 * d * d + 2 * d + d * d + 3 * d * ff + 4 * d
    assert sizes["huginn-0125"] == 8 * block + V * d + 2 * d * d + d


def test_norm_placements_are_the_formulas_with_exact_sizes():
    base = dict(vocab_size=64, d_model=16, n_core=1, n_loops=1, d_ff=24, attention={"n_heads": 2})
    models = {
        p: looplm.build(ModelConfig.from_dict({**base, "norm_placement": p})) for p in ("pre", "sandwich", "post-sum")
    }
    n = {p: m.num_params() for p, m in models.items()}
    assert n["sandwich"] == n["post-sum"] == n["pre"] + 2 * 16  # one more RMSNorm per branch
    x = torch.randn(2, 5, 16)
    for p, m in models.items():
        b = m.core.stack.blocks[0]
        for norm in (b.mixer_out_norm, b.mlp_out_norm):
            if norm is not None:
                norm.weight.data.uniform_(0.5, 1.5)
        fctx = m.forward_context(torch.zeros(2, 5, dtype=torch.long), None, None, 0)
        att = lambda u: b.mixer(u, fctx)  # noqa: E731
        if p == "pre":
            h = x + att(b.mixer_norm(x))
            want = h + b.mlp(b.mlp_norm(h))
        elif p == "sandwich":
            h = x + b.mixer_out_norm(att(b.mixer_norm(x)))
            want = h + b.mlp_out_norm(b.mlp(b.mlp_norm(h)))
        else:
            h = b.mixer_out_norm(x + att(b.mixer_norm(x)))
            want = b.mlp_out_norm(h + b.mlp(b.mlp_norm(h)))
        torch.testing.assert_close(b(x, fctx), want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ConfigError, match="norm_placement: 'post' is not one of"):
        ModelConfig.from_dict({**base, "norm_placement": "post"})


def test_attention_options_are_validated():
    base = dict(vocab_size=64, d_model=16, n_core=2, n_loops=1, d_ff=24)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(
            {
                **base,
                "attention": {
                    "n_heads": 2,
                    "bias": True,
                    "qk_bias": True,
                    "sliding_window": 0,
                    "sliding_layer_idx": [7],
                },
            }
        )
    for s in (
        "qk_bias: bias already",
        "sliding_window: must be >= 1",
        "sliding_layer_idx: [7] are not attention layers",
    ):
        assert s in str(e.value)
    m = looplm.build(ModelConfig.from_dict({**base, "attention": {"n_heads": 2, "qk_bias": True}}))
    a = m.core.stack.blocks[0].mixer
    assert a.q_proj.bias is not None and a.k_proj.bias is not None and a.v_proj.bias is None and a.o_proj.bias is None


def test_random_initial_state():
    """``TN(0, σ²)`` at ±3σ per token position and channel, a fixed function of (seed, position, channel)."""
    pos = torch.arange(4000)[None]
    x = position_noise(pos, 64, seed=0, std=0.5)  # [1, 4000, 64]
    assert x.abs().max() <= 1.5 + 1e-6 and x.abs().max() > 1.4
    trunc_std = 0.5 * math.sqrt(1 - 2 * 3 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
    assert abs(float(x.std()) - trunc_std) < 0.005 and abs(float(x.mean())) < 0.005
    # uniform after the CDF: every decile holds about a tenth
    u = 0.5 * (1 + torch.erf(x.double() / 0.5 / math.sqrt(2)))
    counts = torch.histc(u.float(), bins=10, min=0.0013, max=0.9987)
    assert (counts / counts.sum() - 0.1).abs().max() < 0.01
    # decorrelated across neighbouring positions and channels
    assert abs(float(torch.corrcoef(torch.stack([x[0, :-1].flatten(), x[0, 1:].flatten()]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([x[0, :, :-1].flatten(), x[0, :, 1:].flatten()]))[0, 1])) < 0.02
    assert torch.equal(position_noise(pos[:, 100:110], 64, 0, 0.5), x[:, 100:110])  # any slice of positions
    assert not torch.equal(position_noise(pos, 64, 1, 0.5), x)
    # options: init_seed null = fresh draws from torch's generator each forward
    cfg = dict(
        vocab_size=64,
        d_model=16,
        n_core=1,
        n_loops=2,
        d_ff=24,
        attention={"n_heads": 2},
        rule={"name": "injection", "options": {"form": "dense", "init_state": "normal", "init_std": 0.3}},
    )
    det = looplm.build(cfg).eval()
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.equal(det(ids).logits, det(ids).logits)
    fresh = looplm.build(cfg, overrides={"rule.options.init_seed": None}).eval()
    with torch.no_grad():
        assert not torch.equal(fresh(ids).logits, fresh(ids).logits)
    with pytest.raises(ConfigError) as e:
        looplm.build(
            cfg,
            overrides={
                "rule.options.init_state": "random",
                "rule.options.init_seed": 1.5,
                "rule.options.finish_norm": "yes",
            },
        )
    for s in (
        "init_state: must be one of ['prelude', 'zeros', 'normal']",
        "init_seed: must be an integer",
        "finish_norm: must be true or false",
    ):
        assert s in str(e.value)


def test_exit_gate_options():
    cfg = dict(
        vocab_size=64,
        d_model=16,
        n_core=1,
        n_loops=3,
        d_ff=24,
        attention={"n_heads": 2},
        rule={"name": "exit_gate", "options": {"gate_norm": True, "inter_norm": True}},
    )
    with pytest.raises(ConfigError) as e:
        looplm.build(cfg, overrides={"rule.options.objective": "logits", "rule.options.gate_norm": 1})
    assert "objective: must be one of ['expected_loss', 'expected_logits']" in str(e.value)
    assert "gate_norm: must be true or false" in str(e.value)
    with pytest.raises(ConfigError, match="expected_logits is a stage-1 objective"):
        looplm.build(cfg, overrides={"rule.options.objective": "expected_logits", "rule.options.stage": 2})


def test_expected_logits_loss_is_ouros_and_fine_tuning_lowers_it(ouro):
    """The training loss of Ouro's modelling code: CE of ``Σ_k p_k logits_k`` (its labels path); a few AdamW
    steps on one batch of an imported Ouro lower it (fine-tuning through the imported gate and norms)."""
    m = load_model_for_inference(ouro["out"])[0].train()
    cfg, t = ouro["cfg"], ouro["t"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(9))
    out = m(ids, labels=ids)
    _, _, pdf, step_logits = ouro_reference(t, cfg, ids)
    expected = sum(pdf[..., k : k + 1] * z for k, z in enumerate(step_logits))
    want = F.cross_entropy(expected[:, :-1].reshape(-1, expected.shape[-1]), ids[:, 1:].reshape(-1))
    _close(out.loss, want, "Ouro's expected-logits loss")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = float(out.loss.detach())
    for _ in range(5):
        opt.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        assert m.rule.gate.weight.grad.abs().sum() > 0 and m.norm.weight.grad.abs().sum() > 0
        opt.step()
    with torch.no_grad():
        assert float(m(ids, labels=ids).loss) < first


# ------------------------------------------------------------------------------------------------
# the command line, end to end
# ------------------------------------------------------------------------------------------------


def _mc_task(d: Path) -> Path:
    import yaml

    d.mkdir(parents=True, exist_ok=True)
    rows = [{"q": f"{a} and {a} make", "choices": [f" {2 * a}", f" {a}", " loops"], "label": 0} for a in range(4)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "local_mc.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "local_mc",
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"train": str(d / "mc.jsonl")}},
                "test_split": "train",
                "output_type": "multiple_choice",
                "doc_to_text": "{{q}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}",
                "metric_list": [{"metric": "acc"}],
                "metadata": {"version": 1.0},
            }
        )
    )
    return d


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_cli_import_generate_harness_analyze_end_to_end(family, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write = write_ouro if family == "ouro" else write_huginn
    src, cfg, t = write(tmp_path / "src", K=3)
    run = tmp_path / "run"
    assert cli_main(["import", "hf", str(src), str(run)]) == 0
    assert cli_main(["import", "hf", str(src), str(run)]) == 2  # refuses to overwrite, before loading anything
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(run), "--prompt", "loop", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
    tasks = _mc_task(tmp_path / "tasks")
    accs = []
    for r in (1, 2, 3):
        res_file = tmp_path / f"r{r}.json"
        assert (
            cli_main(
                [
                    "eval",
                    "harness",
                    str(run),
                    "--tasks",
                    "local_mc",
                    "--include-path",
                    str(tasks),
                    "--loops",
                    str(r),
                    "--output-json",
                    str(res_file),
                ]
            )
            == 0
        )
        res = json.loads(res_file.read_text())
        assert res["config"]["loops"] == r
        accs.append(res["results"]["local_mc"]["acc,none"])
    assert all(0 <= a <= 1 for a in accs)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the loop runs again and again; a looped model reads its own state. " * 20)
    capsys.readouterr()
    # eval threshold: Ouro's exit gate sweeps q (selected depth vs executed depth); both run the fixed-depth ablation
    assert (
        cli_main(
            [
                "eval",
                "threshold",
                str(run),
                "--data",
                str(corpus),
                "--batches",
                "1",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--loops",
                "1",
                "2",
                "3",
                "5",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert ("| threshold | 0.20 |" in table) == (family == "ouro") and "| fixed | 5 | 5.00 | 5 |" in table
    assert (
        cli_main(
            [
                "analyze",
                str(run),
                "--metrics",
                "angular-distance,update-norm",
                "--loops",
                "3",
                "--data",
                str(corpus),
                "--batches",
                "1",
                "--calib-batches",
                "0",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--out",
                str(tmp_path / "an"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "an" / "angular-distance.json").read_text())
    assert res["analysis"] == "angular-distance"


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_looplm_train_fine_tunes_and_retrofits_an_import(family, ouro, huginn, tmp_path):
    """``train.init_from`` an imported checkpoint: fine-tuning the same architecture (every weight loaded), and
    retrofitting its layers into another (p, s, K, c) through a layer map."""
    from looplm.train import Trainer, load_train_config

    f = ouro if family == "ouro" else huginn
    run = Path(f["out"])
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the loop runs again and again\n" for i in range(100)))

    def cfg(**over):
        train = {
            "global_batch_size": 2,
            "micro_batch_size": 2,
            "max_steps": 2,
            "precision": "fp32",
            "cpu_threads": 1,
            "init_from": str(run),
        }
        train.update(over.pop("train", {}))
        return load_train_config(
            {
                "model": str(run / "model.yaml"),
                **over,
                "data": {
                    "source": "files",
                    "paths": [str(corpus)],
                    "split_mode": "lines",
                    "seq_len": 16,
                    "shuffle_buffer": 10,
                    "val_every_nth": 0,
                    "tokenizer": str(run / "tokenizer"),
                },
                "train": train,
                "eval": {"every": 0, "batches": 1, "at_end": False},
                "checkpoint": {"every": 0, "at_end": True},
                "logging": {"progress_bar": False, "tensorboard": False},
            }
        )

    Trainer(cfg(), tmp_path / "ft", quiet=True).fit()
    tuned, _ = load_model_for_inference(tmp_path / "ft")
    before = f["model"].state_dict()
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and set(tuned.state_dict()) == set(before)
    rows = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    # retrofit: the imported physical layers into a new layout (Ouro 2 layers -> core of 1 + coda of 1)
    if family == "ouro":
        over, layer_map = {"n_core": 1, "n_coda": 1, "n_loops": 2}, {"core": [0], "coda": [1]}
    else:  # Huginn prelude 1, core 2, coda 1 -> prelude 2, core 1, coda 1
        over, layer_map = (
            {"n_prelude": 2, "n_core": 1, "n_coda": 1, "n_loops": 3},
            {"prelude": [0, 1], "core": [2], "coda": [3]},
        )
    Trainer(cfg(model_overrides=over, train={"init_map": layer_map, "max_steps": 1}), tmp_path / "rf", quiet=True).fit()
    assert load_model_for_inference(tmp_path / "rf")[0].config.n_core == 1
