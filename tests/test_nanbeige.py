"""Nanbeige4.2 in looplm (``looplm.hf.nanbeige`` through ``looplm.hf.public``): a tiny random checkpoint written
here in Nanbeige's own format (``config.json`` with the release's fields, ``model.safetensors`` with its tensor
names; GQA and a head dim that is not hidden / heads, so q_proj and o_proj are not square) is imported and compared
with a reference built from transformers' own Llama modules (``LlamaDecoderLayer``, ``LlamaRMSNorm``,
``LlamaRotaryEmbedding``) run pass after pass with the final norm between passes — none of looplm's model code.
Logits at 1, 2 and 3 passes on left-padded rows, cached greedy decoding, ``skip_loop_final_norm``; the refusals
(each unsupported feature named, before any weight is read; bad, missing and unexpected tensors); export back to
Nanbeige's format (bit-exact tensors and config) and looplm's; per-token exit, the shared KV policy's effect on the
logits and its memory, the serving engine and ``eval harness`` on the import; the preset's exact size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import looplm
from looplm.checkpoint_io import load_model_for_inference
from looplm.cli import main as cli_main
from looplm.hf.importer import import_hf
from looplm.hf.public import PublicFormatError, export_original, family_of, load_public

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = RTOL = 1e-5  # fp32: |looplm − reference| <= 1e-5 + 1e-5·|reference|
DIMS = dict(V=272, dm=32, L=2, H=4, kv=2, hd=16, ff=48, K=2)  # hd·H = 64 != dm = 32: q 32 -> 64, o 64 -> 32


def _write_tokenizer(d: Path):
    from transformers import PreTrainedTokenizerFast

    from looplm.hf.tokenizer import byte_backend

    fast = PreTrainedTokenizerFast(
        tokenizer_object=byte_backend(), eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(d))
    return fast


def write_nanbeige(
    d: Path,
    *,
    V=272,
    dm=32,
    L=2,
    H=4,
    kv=2,
    hd=16,
    ff=48,
    K=2,
    tie=False,
    skip=False,
    dtype=torch.float32,
    shards=1,
    seed=0,
    extra_tensors=None,
    **extra,
):
    """A Nanbeige checkpoint directory (the release's config fields and tensor names); ``(dir, config, tensors)``."""
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    fast = _write_tokenizer(d)
    cfg = {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        "vocab_size": V,
        "hidden_size": dm,
        "intermediate_size": ff,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "kv_channels": hd,
        "hidden_act": "silu",
        "max_position_embeddings": 64,
        "rope_theta": 70000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "num_loops": K,
        "loop_loss_weights": [],
        "skip_loop_final_norm": skip,
        "pretraining_tp": 1,
        "tie_word_embeddings": tie,
        "pad_token_id": fast.pad_token_id,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
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
            p + "input_layernorm.weight": 1 + r(dm, std=0.1),
            p + "post_attention_layernorm.weight": 1 + r(dm, std=0.1),
        }
    t["model.norm.weight"] = 1 + r(dm, std=0.1)
    if not tie:
        t["lm_head.weight"] = r(V, dm, std=0.1)
    files = {k: v.to(dtype).contiguous() for k, v in {**t, **(extra_tensors or {})}.items()}
    if shards == 1:
        save_file(files, str(d / "model.safetensors"))
    else:
        names, wmap = sorted(files), {}
        for s in range(shards):
            f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: files[n] for n in names[s::shards]}, str(d / f))
            wmap |= {n: f for n in names[s::shards]}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (d / "config.json").write_text(json.dumps(cfg))
    return d, cfg, {k: v.to(dtype).float() for k, v in t.items()}


# ------------------------------------------------------------------------------------------------
# the reference: transformers' Llama modules, pass after pass (independent of looplm's model code)
# ------------------------------------------------------------------------------------------------


class Reference:
    """Nanbeige's forward from ``transformers``' ``LlamaDecoderLayer`` / ``LlamaRMSNorm`` /
    ``LlamaRotaryEmbedding`` (eager attention, fp32) holding the checkpoint's tensors: ``K`` passes over the same
    layers, the final norm after every pass (or once at the end with ``skip_loop_final_norm``), positions shared
    by every pass."""

    def __init__(self, cfg: dict, t: dict):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        lc = LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"],
            max_position_embeddings=cfg["max_position_embeddings"],
            attention_bias=False,
            mlp_bias=False,
            hidden_act="silu",
        )
        lc._attn_implementation = "eager"
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            layer = LlamaDecoderLayer(lc, i).eval()
            p = f"model.layers.{i}."
            layer.load_state_dict({k[len(p) :]: v for k, v in t.items() if k.startswith(p)}, strict=True)
            self.layers.append(layer)
        self.norm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"]).eval()
        self.norm.weight.data.copy_(t["model.norm.weight"])
        self.rotary = LlamaRotaryEmbedding(lc)
        self.E, self.head = t["model.embed_tokens.weight"], t.get("lm_head.weight", t["model.embed_tokens.weight"])
        self.K, self.skip = cfg["num_loops"], cfg["skip_loop_final_norm"]

    @torch.no_grad()
    def __call__(self, ids, mask=None, K=None, states=False):
        B, T = ids.shape
        mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
        allowed = allowed | torch.eye(T, dtype=torch.bool)[None]  # (a padded query sees itself: no NaN)
        bias = torch.zeros(B, 1, T, T).masked_fill(~allowed[:, None], float("-inf"))
        h = self.E[ids]
        pe = self.rotary(h, pos)
        passes = []
        for _ in range(K or self.K):
            for layer in self.layers:
                out = layer(h, attention_mask=bias, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            if not self.skip:
                h = self.norm(h)  # the final norm ends every pass and feeds the next
            passes.append(h)
        y = self.norm(h) if self.skip else h
        logits = y @ self.head.T
        return (logits, passes) if states else logits


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _padded_batch(V, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids, mask


@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    root = tmp_path_factory.mktemp("nanbeige")
    src, cfg, t = write_nanbeige(root / "src")
    out = import_hf(src, root / "run")
    model, tok = load_model_for_inference(out)
    return dict(src=src, cfg=cfg, t=t, out=out, model=model, tok=tok, ref=Reference(cfg, t))


# ------------------------------------------------------------------------------------------------
# the import and its parity
# ------------------------------------------------------------------------------------------------


def test_import_is_a_baseloop_with_the_norm_between_passes(nb):
    m, cfg = nb["model"], nb["model"].config
    assert (cfg.n_prelude, cfg.n_core, cfg.n_loops, cfg.n_coda) == (0, 2, 2, 0)
    assert cfg.rule.name == "vanilla" and cfg.rule.options == {"inter_norm": True}
    assert (cfg.norm_placement, cfg.head_dim, cfg.n_kv_heads, cfg.attention.rope_precision) == ("pre", 16, 2, "fp32")
    assert cfg.attention.rope_theta == 7e7 and not cfg.tie_embeddings
    q, o = m.core.stack.blocks[0].mixer.q_proj.weight, m.core.stack.blocks[0].mixer.o_proj.weight
    assert tuple(q.shape) == (64, 32) and tuple(o.shape) == (32, 64)  # not square
    rec = json.loads((Path(nb["out"]) / "config.json").read_text())
    assert rec["import"]["imported_kind"] == "nanbeige" and rec["import"]["original_config"]["num_loops"] == 2
    tok_cfg = json.loads((Path(nb["out"]) / "tokenizer" / "tokenizer_config.json").read_text())
    tmpl = tok_cfg.get("chat_template") or (Path(nb["out"]) / "tokenizer" / "chat_template.jinja").read_text()
    assert "m['role']" in tmpl  # the chat template came with the tokenizer
    backend = nb["tok"]._tok  # what looplm serve's chat endpoint renders with
    assert backend.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi"


@pytest.mark.parametrize("r", [1, 2, 3])  # trained num_loops = 2, fewer and more
def test_logits_match_transformers_llama_layers_looped(nb, r):
    m, cfg = nb["model"], nb["cfg"]
    ids, mask = _padded_batch(cfg["vocab_size"], r)
    with torch.no_grad():
        out = m(ids, attention_mask=mask, num_loops=r, output_iterations=True)
    want, passes = nb["ref"](ids, mask, K=r, states=True)
    real = mask.bool()
    _close(out.logits[real], want[real], f"logits at {r} pass(es)")
    for k, (h, ref) in enumerate(zip(out.iterations, passes)):
        _close(m.norm(h)[real], ref[real], f"normed state after pass {k + 1}")
    if r == 2:  # the passes and the norm between them matter: not a model whose second pass does nothing
        assert (out.logits - nb["ref"](ids, mask, K=1))[real].abs().max() > 1e-2
        skip = Reference({**cfg, "skip_loop_final_norm": True}, nb["t"])
        assert (out.logits - skip(ids, mask))[real].abs().max() > 1e-2


def test_skip_loop_final_norm_true_is_plain_looping(tmp_path):
    src, cfg, t = write_nanbeige(tmp_path / "s", skip=True, seed=3)
    m, _, _ = load_public(src)
    assert m.config.rule.options == {"inter_norm": False}
    ids, mask = _padded_batch(cfg["vocab_size"], 5)
    with torch.no_grad():
        got = m(ids, attention_mask=mask).logits
    _close(got[mask.bool()], Reference(cfg, t)(ids, mask)[mask.bool()], "skip_loop_final_norm: true")


def test_cached_greedy_decoding_matches_the_reference(nb):
    """``generate`` (a KV slot per (pass, layer), a left-padded batch) decodes the reference's tokens."""
    m, cfg, ref = nb["model"], nb["cfg"], nb["ref"]
    ids, mask = _padded_batch(cfg["vocab_size"], 11)
    with torch.no_grad():
        got = m.generate(ids, max_new_tokens=6, attention_mask=mask)
        want_ids, want_mask = ids, mask
        for _ in range(6):
            nxt = ref(want_ids, want_mask)[:, -1].argmax(-1, keepdim=True)
            want_ids, want_mask = torch.cat([want_ids, nxt], 1), torch.cat([want_mask, torch.ones_like(nxt)], 1)
    assert torch.equal(got[:, -6:], want_ids[:, -6:])
    from helpers import assert_cached_equals_full

    assert_cached_equals_full(m, atol=1e-5)


def test_tied_head_shards_bf16_and_rope_buffers(tmp_path):
    """A tied head (absent, or present and equal), two shards, bf16 files, the RoPE buffers some copies carry."""
    buffers = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "model.rotary_emb.inv_freq": torch.ones(8),
    }
    src, cfg, t = write_nanbeige(tmp_path / "a", tie=True, shards=2, dtype=torch.bfloat16, extra_tensors=buffers)
    m, _, _ = load_public(src)
    assert m.config.tie_embeddings and m.lm_head.weight is m.embed.weight
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _close(m(ids).logits, Reference(cfg, t)(ids), "tied, bf16 weights in fp32")
    src, cfg, t = write_nanbeige(tmp_path / "b", tie=True, extra_tensors={"lm_head.weight": torch.ones(272, 32)})
    with pytest.raises(PublicFormatError, match="holds other values"):
        load_public(src)


# ------------------------------------------------------------------------------------------------
# refusals (before any weight is read)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("enable_hyper_connection", True),
        ("enable_mhc", True),
        ("enable_depth_attention", True),
        ("enable_double_loop_split", True),
        ("loop_share_kv", True),
        ("qk_layernorm", True),
        ("insert_ngram_layer_idx", [3]),
        ("ngram_insert_all_layers", True),
        ("loop_loss_weights", [0.5]),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("mhc_double_stream_position_for_loop", "mid"),
    ],
)
def test_unsupported_features_are_refused_naming_the_field(field, value, tmp_path):
    src, _, _ = write_nanbeige(tmp_path / "src", **{field: value})
    (src / "model.safetensors").write_bytes(b"not a safetensors file")  # never read: the config is refused first
    with pytest.raises(PublicFormatError, match=rf"{field}={value!r}".replace("[", r"\[").replace("]", r"\]")):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_other_config_refusals_are_listed_together(tmp_path):
    src, _, _ = write_nanbeige(
        tmp_path / "src",
        emb_neighbor_num=3,
        emb_split_num=4,
        ngram_vocab_size_ratio=8,
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
        hidden_act="gelu",
        jang_runtime={"cache_layout": "looped_kv_v1"},
        skip_loop_final_norm="no",
    )
    (src / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(PublicFormatError) as e:
        load_public(src)
    msg = str(e.value)
    for s in (
        "emb_neighbor_num / emb_split_num / ngram_vocab_size_ratio = [3, 4, 8]: n-gram embeddings",
        "rope_scaling with rope_type 'yarn'",
        "hidden_act 'gelu'",
        "jang_runtime=",
        "is not a field looplm's Nanbeige port knows",
        "skip_loop_final_norm must be true or false",
    ):
        assert s in msg, s
    # sub-options of features that are off, and unknown fields whose value is off, load
    src, cfg, t = write_nanbeige(
        tmp_path / "ok",
        emb_neighbor_num=None,
        emb_split_num=4,
        num_residual_streams=4,
        mhc_sinkhorn_iterations=20,
        depth_attention_stride=2,
        enable_hyper_connection=False,
        some_future_flag=False,
        rope_parameters={"rope_type": "default", "rope_theta": 7e7},
        total_ut_steps=2,
        early_exit_threshold=1.0,
    )
    assert load_public(src)[0].config.n_loops == 2
    src, _, _ = write_nanbeige(tmp_path / "ut", total_ut_steps=3, early_exit_threshold=0.5)
    with pytest.raises(
        PublicFormatError, match=r"(?s)total_ut_steps=3 disagrees with num_loops=2.*early_exit_threshold=0.5"
    ):
        load_public(src)
    src, _, _ = write_nanbeige(tmp_path / "missing")
    c = json.loads((src / "config.json").read_text())
    del c["rope_theta"], c["intermediate_size"]
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(PublicFormatError, match=r"(?s)missing field 'intermediate_size'.*missing field 'rope_theta'"):
        load_public(src)


def test_bad_missing_and_unexpected_tensors_are_named(tmp_path):
    src, cfg, t = write_nanbeige(tmp_path / "src")
    t = {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"}
    t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 32)  # square: hidden / heads instead of head_dim
    t["model.layers.0.hc.weight"] = torch.zeros(4)
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(Exception) as e:
        import_hf(src, tmp_path / "out")
    msg = str(e.value)
    for s in (
        "missing 1: model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight [32, 32] (expected [32, 64])",
        "unexpected 1: model.layers.0.hc.weight",
    ):
        assert s in msg, s
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# export: Nanbeige's own format and looplm's
# ------------------------------------------------------------------------------------------------


def test_export_original_round_trips_bit_exact(nb, tmp_path):
    out = export_original(nb["out"], tmp_path / "orig")
    written = load_file(str(out / "model.safetensors"))
    src = load_file(str(nb["src"] / "model.safetensors"))
    assert written.keys() == src.keys() and all(torch.equal(written[k], src[k]) for k in src)
    assert json.loads((out / "config.json").read_text()) == nb["cfg"]  # the release's fields, the same values
    again = import_hf(out, tmp_path / "again")
    m2, _ = load_model_for_inference(again)
    assert m2.config == nb["model"].config
    assert all(torch.equal(v, nb["model"].state_dict()[k]) for k, v in m2.state_dict().items())
    assert cli_main(["export", "hf", str(nb["out"]), str(tmp_path / "cli"), "--format", "original"]) == 0
    assert load_file(str(tmp_path / "cli" / "model.safetensors")).keys() == src.keys()
    code = tmp_path / "code"
    code.mkdir()
    (code / "modeling_nanbeige.py").write_text("# stand-in\n")
    with pytest.raises(FileNotFoundError, match="configuration_nanbeige.py"):
        export_original(nb["out"], tmp_path / "none", reference_code=code)
    (code / "configuration_nanbeige.py").write_text("# stand-in\n")
    cfg = json.loads((export_original(nb["out"], tmp_path / "with", reference_code=code) / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_nanbeige.NanbeigeForCausalLM"


def test_export_looplm_format_round_trips_and_family_of(nb, tmp_path):
    from looplm.hf.export import export_hf

    out = export_hf(nb["out"], tmp_path / "hf")
    back, _ = load_model_for_inference(import_hf(out, tmp_path / "back"))
    assert back.config == nb["model"].config
    assert all(torch.equal(v, nb["model"].state_dict()[k]) for k, v in back.state_dict().items())
    assert family_of(looplm.build("nanbeige4.2-3b", device="meta").config) == "nanbeige"
    with pytest.raises(PublicFormatError, match=r"as Nanbeige it needs attention.rope_precision: fp32.*\(is fp64\)"):
        family_of(looplm.build("tiny-llama").config)


# ------------------------------------------------------------------------------------------------
# the tools on the import: per-token exit, shared KV, serving, eval harness
# ------------------------------------------------------------------------------------------------


def test_generate_with_exit_criteria(nb):
    """kl / convergence compare successive passes, so at the trained 2 passes nobody can leave after the first
    (the criterion needs the second pass's output): the tokens and depths are full depth's. With a third pass
    allowed (``max_loops=3``) a token leaves after pass 2 when KL(p¹ ‖ p²) (or the relative update) is small."""
    m, cfg = nb["model"], nb["cfg"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m.generate(ids, 8)
        for crit in ("kl:10.0", "convergence:10.0"):
            out, st = m.generate(ids, 8, exit=crit, return_stats=True)
            assert torch.equal(out, full), crit
            assert set(torch.cat([s.reshape(-1) for s in st.selected]).tolist()) == {2}
        deep3 = m.generate(ids, 8, num_loops=3)
        out, st = m.generate(ids, 8, exit={"criterion": "kl", "threshold": 0.0, "max_loops": 3}, return_stats=True)
        assert torch.equal(out, deep3)  # ε = 0: every token runs the 3 passes
        out, st = m.generate(
            ids, 8, exit={"criterion": "convergence", "threshold": 10.0, "max_loops": 3}, return_stats=True
        )
        assert set(torch.cat([s.reshape(-1) for s in st.selected]).tolist()) == {2}  # every token left after pass 2
        assert st.summary()["executed_depth"] < 3


def _cache_bytes(cache) -> int:
    seen, total = set(), 0
    for s in cache.physical_slots():
        for t in (getattr(s, "_k", None), getattr(s, "_v", None)):
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_shared_kv_policy_halves_the_cache_and_moves_the_logits(nb):
    """kv_policy ``shared`` (one slot per layer for both passes): half the cache; teacher-forced logits at full
    depth move (pass 1 of a token reads earlier tokens' pass-2 keys) — the measured max |Δ logit| on the tiny
    import is recorded in docs/public-models.md."""
    from looplm.decode.token_schedule import AdaptiveDecoder

    m, cfg = nb["model"], nb["cfg"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = m(ids).logits
        logits, size = {}, {}
        for kv in ("copy", "shared"):
            dec = AdaptiveDecoder(m, 2, 24, {"criterion": "replay", "depths": 2, "kv": kv})
            logits[kv] = dec.score(ids, prompt_len=1)
            size[kv] = _cache_bytes(dec.cache)
    _close(logits["copy"], want, "token by token at full depth (a slot per pass)")
    diff = float((logits["shared"] - want).abs().max())
    assert 1e-3 < diff < 50.0, diff
    assert size["copy"] == 2 * size["shared"]
    # the release's numbers: 2 (K, V) x 8 KV heads x 128 x 2 bytes (bf16) per token per (pass, layer) slot
    c = looplm.build("nanbeige4.2-3b", device="meta").config
    per_slot = 2 * c.n_kv_heads * c.head_dim * 2
    assert per_slot * c.n_core * c.n_loops * 262_144 == 47_244_640_256  # 44 slots at 256K: 47.2 GB
    assert per_slot * c.n_core * 262_144 == 23_622_320_128  # shared: 22 slots, 23.6 GB


def test_serving_engine_on_the_import(nb):
    from looplm.serve import Engine, EngineConfig, FinishEvent, SamplingParams, TokenEvent

    m = nb["model"]
    prompts = [[5, 9, 3, 12], [7, 1, 2, 8, 30, 4, 6]]
    want = [m.generate(torch.tensor([p]), 5)[0, len(p) :].tolist() for p in prompts]
    eng = Engine(m, EngineConfig(max_batch=2)).start()
    try:
        import threading

        got = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def collect(i):
            def cb(ev):
                if isinstance(ev, TokenEvent):
                    got[i].append(ev.token_id)
                elif isinstance(ev, FinishEvent):
                    done[i].set()

            return cb

        for i, p in enumerate(prompts):
            eng.submit(p, SamplingParams(max_tokens=5, temperature=0), collect(i))
        assert all(d.wait(60) for d in done)
    finally:
        eng.shutdown()
    assert got == want


def test_cli_generate_and_eval_harness(nb, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    import yaml

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = str(nb["out"])
    assert (
        cli_main(["generate", "--checkpoint", run, "--prompt", "loop", "--max-new-tokens", "4", "--exit", "kl:0.01"])
        == 0
    )
    d = tmp_path / "tasks"
    d.mkdir()
    rows = [{"q": f"{a} and {a} make", "choices": [f" {2 * a}", f" {a}"], "label": 0} for a in range(3)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "nb_mc.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "nb_mc",
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
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the loop runs again and again; a looped model reads its own state. " * 20)
    capsys.readouterr()
    assert (
        cli_main(
            [
                "eval",
                "threshold",
                run,
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
            ]
        )
        == 0
    )
    assert "| fixed | 2 | 2.00 | 2 |" in capsys.readouterr().out
    assert (
        cli_main(
            [
                "analyze",
                run,
                "--metrics",
                "angular-distance",
                "--loops",
                "2",
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
    res_file = tmp_path / "r.json"
    assert (
        cli_main(
            [
                "eval",
                "harness",
                run,
                "--tasks",
                "nb_mc",
                "--include-path",
                str(d),
                "--loops",
                "1",
                "--output-json",
                str(res_file),
            ]
        )
        == 0
    )
    res = json.loads(res_file.read_text())
    assert res["config"]["loops"] == 1 and 0 <= res["results"]["nb_mc"]["acc,none"] <= 1


def test_preset_size():
    """Exact count on the meta device: 22 layers of 4·... (q, o: d x H·hd; k, v: d x kv·hd), SwiGLU, two norms;
    untied embeddings and head; the final norm. The card's "~3B non-embedding parameters" is the layers + norm."""
    n = looplm.build("nanbeige4.2-3b", device="meta").num_params()
    d, V, ff, L, H, kv, hd = 3072, 166_144, 10_752, 22, 48, 8, 128
    layer = 2 * d * H * hd + 2 * d * kv * hd + 3 * d * ff + 2 * d
    assert n == L * layer + 2 * V * d + d == 4_169_800_704
    assert n - 2 * V * d == 3_149_011_968 and math.isclose((n - 2 * V * d) / 1e9, 3.15, abs_tol=0.005)


def test_last_pass_agreement_is_the_kl_between_the_two_passes(nb, tmp_path):
    """The by-hand measurement (``benchmarks/check_nanbeige_pass1.py``): per token KL(p¹ ‖ p²) of the reference's
    two passes, the fraction below each ε (monotone), top-1 agreement."""
    from looplm.hf.nanbeige import last_pass_agreement

    m, cfg = nb["model"], nb["cfg"]
    ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(8))
    res = last_pass_agreement(m, ids, thresholds=(1e-2, 0.1, 1.0, 1e9))
    _, passes = nb["ref"](ids, states=True)
    lp = [torch.log_softmax(h @ nb["t"]["lm_head.weight"].T, -1) for h in passes]
    kl = (lp[0].exp() * (lp[0] - lp[1])).sum(-1)
    assert res["tokens"] == 32 and res["passes"] == (1, 2)
    assert math.isclose(res["kl_mean"], float(kl.mean()), rel_tol=1e-4)
    assert math.isclose(res["top1_agreement"], float((lp[0].argmax(-1) == lp[1].argmax(-1)).float().mean()))
    fr = list(res["below"].values())
    assert fr == sorted(fr) and fr[-1] == 1.0 and fr[0] < 1.0
    with pytest.raises(ValueError, match=">= 2 passes"):
        last_pass_agreement(looplm.build("tiny-llama", overrides={"n_loops": 1}), ids)


def test_cli_refusal_is_one_error_no_traceback(tmp_path):
    import subprocess
    import sys

    src, _, _ = write_nanbeige(tmp_path / "src", enable_depth_attention=True, num_loops=0)
    r = subprocess.run(
        [sys.executable, "-m", "looplm.cli", "import", "hf", str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error: ")
    assert "enable_depth_attention=True" in r.stderr and "num_loops must be a positive integer, got 0" in r.stderr
    assert not (tmp_path / "out").exists()


def test_vanilla_inter_norm_option_is_the_norm_between_passes():
    """``Z^{k+1} = N(H^k)``: two unrolled calls of the core with the final norm between them and at the end."""
    from looplm.dataclass_util import ConfigError

    m = looplm.build("tiny-llama", overrides={"n_loops": 2, "rule.options.inter_norm": True}).eval()
    x = torch.randint(0, 260, (2, 6))
    with torch.no_grad():
        fctx = m.forward_context(x, None, None, 0)
        h = m.embed(x)
        for _ in range(2):
            for b in m.core.stack.blocks:
                h = b(h, fctx)
            h = m.norm(h)
        torch.testing.assert_close(m(x).logits, m.lm_head(h), atol=1e-5, rtol=1e-5)
        plain = looplm.build(m.config.replace(rule={"name": "vanilla"}))
        plain.load_state_dict(m.state_dict())
        assert (plain.eval()(x).logits - m(x).logits).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="inter_norm: must be true or false"):
        looplm.build("tiny-llama", overrides={"rule.options.inter_norm": "yes"})
