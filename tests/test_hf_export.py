"""Hugging Face export / import: the exported model is looplm's, through transformers' own API, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import looplm
from looplm.cli import main as cli_main
from looplm.data.tokenizers import ByteTokenizer
from looplm.hf.export import export_hf
from looplm.hf.importer import import_hf, read_export, write_checkpoint
from looplm.recurrence import RULES

from helpers import tiny_variant


def _perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Random weights everywhere, so zero-initialised gates and rule parameters take part too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def _load(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()


def _prompt(n: int = 7, seed: int = 1, vocab: int = 200) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tiny-coreloop ((p, s, K, c) = (1, 2, 3, 1)) with random weights, exported once."""
    torch.manual_seed(0)
    model = _perturb(looplm.build("tiny-coreloop"))
    out = export_hf(model, tmp_path_factory.mktemp("hf") / "coreloop", tokenizer="byte")
    return model, out, _load(out)


def test_export_layout_and_remote_code(exported):
    model, out, hf = exported
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_looplm.py",
        "configuration_looplm.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "looplm" and cfg["looplm"]["rule"]["name"] == model.config.rule.name
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_looplm.LoopLMForCausalLM"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    # loaded through the remote-code path (the copy in the export), not a class of this process
    assert type(hf).__module__.startswith("transformers_modules")
    assert type(hf).__name__ == "LoopLMForCausalLM"


def test_logits_and_loss_equal_looplm(exported):
    model, _, hf = exported
    ids = _prompt(12)
    with torch.no_grad():
        ours = model(ids, labels=ids)
        theirs = hf(ids, labels=ids)
    assert torch.equal(ours.logits, theirs.logits)
    assert torch.equal(ours.loss, theirs.loss)
    with torch.no_grad():  # another loop count through forward()
        assert torch.equal(model(ids, num_loops=5).logits, hf(ids, num_loops=5).logits)


def test_cached_greedy_equals_uncached_and_looplm(exported):
    model, _, hf = exported
    ids = _prompt(6)
    cached = hf.generate(ids, max_new_tokens=10, do_sample=False)
    uncached = hf.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, model.generate(ids, max_new_tokens=10, use_cache=False))


def test_left_padded_batch_equals_each_alone(exported):
    _, _, hf = exported
    a, b = _prompt(9, seed=2)[0], _prompt(4, seed=3)[0]
    pad = hf.config.pad_token_id
    batch = torch.full((2, 9), pad)
    batch[0], batch[1, 5:] = a, b
    mask = (torch.arange(9)[None] >= torch.tensor([[0], [5]])).long()
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    alone_a = hf.generate(a[None], max_new_tokens=6, do_sample=False)
    alone_b = hf.generate(b[None], max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0], alone_a[0])
    assert torch.equal(out[1, 5:], alone_b[0])


def test_more_loops_at_inference_than_training(exported, tmp_path):
    model, out, hf = exported
    K = model.config.n_loops
    ids = _prompt(5)
    deep = hf.generate(ids, max_new_tokens=8, do_sample=False, num_loops=2 * K)
    assert torch.equal(deep, model.generate(ids, max_new_tokens=8, num_loops=2 * K, use_cache=False))
    # the cache grew to one slot per (loop, core layer) for all 2K loops
    res = hf(ids, num_loops=2 * K, use_cache=True)
    cache = res.cache if "cache" in res else res.past_key_values
    core_slots = {key for key in cache.inner.slots if isinstance(key[0], int) and key[0] > 0}
    assert len(core_slots) == (2 * K - 1) * model.config.n_core
    # a config default: exported with num_loops=2K, plain generate() runs 2K loops
    out2 = export_hf(model, tmp_path / "deep", tokenizer="byte", num_loops=2 * K)
    assert torch.equal(_load(out2).generate(ids, max_new_tokens=8, do_sample=False), deep)
    # a cache holding tokens keeps its loop count
    with pytest.raises(ValueError, match="cannot serve"):
        hf(ids[:, -1:], cache=cache, num_loops=K)


def test_tokenizer_matches_looplm(exported):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, out, _ = exported
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    text = "Héllo, wörld! <eos> \n\t end"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (256, 257, 258)
    auto = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    assert auto(text)["input_ids"] == ByteTokenizer().encode(text)


def test_bpe_tokenizer_exports(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from looplm.data.tokenizers import train_bpe

    texts = ["the quick brown fox jumps over the lazy dog " * 3, "looped models loop their core blocks"] * 20
    bpe = train_bpe(None, 300, tmp_path / "tok", texts=texts)
    model = looplm.build("tiny-llama", vocab_size=320)
    out = export_hf(model, tmp_path / "hf", tokenizer=bpe)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    s = "the lazy fox loops"
    assert tok(s)["input_ids"] == bpe.encode(s)
    assert tok.eos_token_id == bpe.eos_id


def _rule_configs():
    """(rule name, config) for every registered rule: a preset's rule options when a preset uses it
    (at tiny sizes), else the rule's defaults, on tiny-llama's backbone."""
    from looplm.config import list_presets, preset_dict

    first = {}
    for name in list_presets():
        r = (preset_dict(name).get("rule") or {}).get("name", "vanilla")
        first.setdefault(r, name)
    out = []
    for rule in sorted(RULES):
        if rule.startswith("test-"):
            continue
        base = looplm.config.load_model_config("tiny-llama").to_dict()
        if rule in first:
            base["rule"] = tiny_variant(first[rule]).rule.__dict__
            base["rule"] = {"name": rule, "options": dict(base["rule"]["options"])}
        else:
            base["rule"] = {"name": rule, "options": {}}
        out.append(pytest.param(rule, base, id=rule))
    return out


@pytest.mark.parametrize("rule,cfg", _rule_configs())
def test_every_rule_exports(rule, cfg, tmp_path):
    torch.manual_seed(0)
    model = _perturb(looplm.build(cfg))
    out = export_hf(model, tmp_path / rule, tokenizer="byte")
    hf = _load(out)
    assert hf.config.looplm["rule"] == model.config.to_dict()["rule"]
    ids = _prompt(6)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    K = model.config.n_loops
    assert torch.equal(
        hf.generate(ids, max_new_tokens=4, do_sample=False, num_loops=K + 1),
        model.generate(ids, max_new_tokens=4, num_loops=K + 1, use_cache=False),
    )


@torch.no_grad()
def _greedy(model, ids, n, **kw):
    """Greedy decoding by full forwards (no cache): the reference."""
    for _ in range(n):
        nxt = model(ids, **kw).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_exit_threshold_from_generate_and_config(tmp_path):
    torch.manual_seed(0)
    model = _perturb(looplm.build("tiny-llama", overrides={"rule.name": "exit_gate", "n_loops": 4}), scale=0.3)
    ids = _prompt(6)
    out = export_hf(model, tmp_path / "gate", tokenizer="byte")
    hf = _load(out)
    for q in (0.05, 0.9):
        with torch.no_grad():
            ref = model(ids, loop_options={"exit_threshold": q}).logits
            assert torch.equal(hf(ids, exit_threshold=q).logits, ref)
        got = hf.generate(ids, max_new_tokens=4, do_sample=False, exit_threshold=q)
        assert torch.equal(got, _greedy(model, ids, 4, loop_options={"exit_threshold": q}))
    out_q = export_hf(model, tmp_path / "gate-q", tokenizer="byte", exit_threshold=0.05)
    with torch.no_grad():
        assert torch.equal(_load(out_q)(ids).logits, model(ids, loop_options={"exit_threshold": 0.05}).logits)


def test_generate_takes_adaptive_depth_and_speculative_options(tmp_path):
    """exit= / speculative= through the export's generate(): looplm's adaptive decoding, the same tokens; the
    gate's q from exit= (not the config's default q); a request only transformers' loop serves is refused."""
    torch.manual_seed(0)
    model = _perturb(looplm.build("tiny-llama", overrides={"rule.name": "exit_gate", "n_loops": 4}), scale=0.3)
    hf = _load(export_hf(model, tmp_path / "gate", tokenizer="byte"))
    ids = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(1))
    for q in (0.3, 0.7):
        assert torch.equal(
            hf.generate(ids, max_new_tokens=6, do_sample=False, exit=f"gate:{q}"),
            model.generate(ids, 6, exit=f"gate:{q}"),
        )
    got, stats = hf.generate(ids, max_new_tokens=6, do_sample=False, exit="gate:0.3", return_stats=True)
    assert stats.summary()["executed_depth"] < 4
    assert torch.equal(
        hf.generate(ids, max_new_tokens=6, do_sample=False, speculative={"draft_loops": 1, "k": 3}),
        model.generate(ids, 6),
    )
    with pytest.raises(ValueError, match="only transformers' loop"):
        hf.generate(ids, max_new_tokens=3, num_beams=2, exit="gate:0.5")
    with pytest.raises(ValueError, match=r"exit threshold q must be in \(0, 1\]"):
        hf.generate(ids, max_new_tokens=3, exit="gate:1.5")
    with pytest.raises(ValueError, match="disagree"):
        hf.generate(ids, max_new_tokens=3, exit="gate:0.5", exit_threshold=0.9)


# ------------------------------------------------------------------------------------------ import
def test_export_import_round_trip_exact(exported, tmp_path):
    model, out, _ = exported
    ckpt = import_hf(out, tmp_path / "back")
    from looplm.checkpoint_io import load_model_for_inference

    back, tok = load_model_for_inference(ckpt)
    assert back.config == model.config
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert tok.fingerprint() == ByteTokenizer().fingerprint()


def test_cli_export_import_round_trip_bpe(tmp_path):
    """A checkpoint directory -> `looplm export hf` -> `looplm import hf` -> the same weights, config,
    tokenizer ids; `looplm generate` runs on the result."""
    from looplm.data.tokenizers import train_bpe

    texts = ["to be or not to be that is the question " * 2, "whether tis nobler in the mind to suffer"] * 20
    bpe = train_bpe(None, 300, tmp_path / "tok", texts=texts)
    model = _perturb(looplm.build("tiny-qwen3", vocab_size=320))
    ckpt = write_checkpoint(tmp_path / "ckpt", model, bpe)
    assert cli_main(["export", "hf", str(ckpt), str(tmp_path / "hf"), "--loops", "2"]) == 0
    assert cli_main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    from looplm.checkpoint_io import load_model_for_inference

    back, tok = load_model_for_inference(tmp_path / "back")
    assert back.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    assert tok.encode("to be or not") == bpe.encode("to be or not") and tok.eos_id == bpe.eos_id
    assert tok.fingerprint() == bpe.fingerprint()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_loops"] == 2
    assert (
        cli_main(["generate", "--checkpoint", str(tmp_path / "back"), "--prompt", "to be", "--max-new-tokens", "4"])
        == 0
    )


def _byte_hf_tokenizer(path):
    from looplm.hf.tokenizer import to_pretrained_tokenizer_fast

    to_pretrained_tokenizer_fast(ByteTokenizer()).save_pretrained(str(path))


def _tiny_hf(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=260,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=260,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        return transformers.Qwen3ForCausalLM(cfg)
    cfg = transformers.Mamba2Config(
        vocab_size=260,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        head_dim=16,
        num_heads=4,
        n_groups=1,
        chunk_size=8,
    )
    return transformers.Mamba2ForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mamba2"])
def test_import_transformers_models(kind, tmp_path):
    hf = _tiny_hf(kind).eval()
    src = tmp_path / kind
    hf.save_pretrained(str(src))
    _byte_hf_tokenizer(src)
    ckpt = import_hf(src, tmp_path / "ckpt")
    from looplm.checkpoint_io import load_model_for_inference

    model, tok = load_model_for_inference(ckpt)
    ids = _prompt(8, vocab=256)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)
    assert tok.encode("abc") == [97, 98, 99]
    # an imported model loops: the config can be changed on the way in
    looped = import_hf(src, tmp_path / "looped", n_loops=2)
    m2, _ = load_model_for_inference(looped)
    assert m2.config.n_loops == 2


def test_read_export_needs_no_remote_code(exported):
    model, out, _ = exported
    back, tok = read_export(out)
    assert torch.equal(back.embed.weight, model.embed.weight) and tok.name == "byte"


def test_import_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        import_hf(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_hf(tmp_path / "empty", tmp_path / "out")


# ------------------------------------------------------------------------------------------ import integrity
def _llama_dir(tmp_path, name="llama"):
    hf = _tiny_hf("llama").eval()
    src = tmp_path / name
    hf.save_pretrained(str(src))
    _byte_hf_tokenizer(src)
    return src


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


def test_import_refuses_missing_unexpected_or_misshaped_tensors(tmp_path, capsys):
    src = _llama_dir(tmp_path)
    _edit_weights(
        src / "model.safetensors",
        lambda sd: [sd.pop("model.layers.1.self_attn.q_proj.weight"), sd.pop("model.layers.1.mlp.down_proj.weight")],
    )
    # was: exit 0 and a COMPLETE checkpoint with those two tensors drawn from N(0, 0.02)
    assert cli_main(["import", "hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        "do not fit its llama config (missing 2: model.layers.1.mlp.down_proj.weight, "
        "model.layers.1.self_attn.q_proj.weight); nothing was written"
        in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "out").exists()
    src2 = _llama_dir(tmp_path, "llama2")
    _edit_weights(
        src2 / "model.safetensors", lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)})
    )
    with pytest.raises(
        ValueError, match=r"mis-shaped 1: model\.layers\.0\.mlp\.up_proj\.weight \[40, 32\] \(expected \[48, 32\]\)"
    ):
        import_hf(src2, tmp_path / "out")
    # a Llama config.json over looplm weights: every tensor is missing (was: exit 0, an all-random model)
    model = _perturb(looplm.build("tiny-llama"))
    mixed = export_hf(model, tmp_path / "mixed", tokenizer="byte")
    (mixed / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing 21: .*unexpected \d+: looplm\.core"):
        import_hf(mixed, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_of_an_export_checks_its_tensors_too(exported, tmp_path):
    import shutil

    model, out, _ = exported
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    _edit_weights(bad / "model.safetensors", lambda sd: sd.pop("looplm.core.stack.blocks.0.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"do not fit its looplm config .*missing 1: looplm\.core\.stack\.blocks\.0\.mlp\.up_proj"
    ):
        import_hf(bad, tmp_path / "out")  # was: a raw load_state_dict traceback


def test_import_reads_exactly_the_files_the_format_names(exported, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from looplm.checkpoint_io import load_model_for_inference

    model, out, _ = exported
    src = tmp_path / "src"
    shutil.copytree(out, src)
    # a stray backup beside model.safetensors (sorted after it, so it used to win the merge): ignored, with a warning
    stale = {k: torch.zeros_like(v) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(stale, str(src / "model_v0_backup.safetensors"))
    with pytest.warns(UserWarning, match=r"ignoring \['model_v0_backup.safetensors'\]"):
        ckpt = import_hf(src, tmp_path / "a")
    back, _ = load_model_for_inference(ckpt)
    assert torch.equal(back.embed.weight, model.embed.weight)
    # shards listed in model.safetensors.index.json are read; an index beside model.safetensors is ambiguous
    full = load_file(str(src / "model.safetensors"))
    keys = sorted(full)
    half = len(keys) // 2
    save_file({k: full[k] for k in keys[:half]}, str(src / "model-00001-of-00002.safetensors"))
    save_file({k: full[k] for k in keys[half:]}, str(src / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(keys)},
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        import_hf(src, tmp_path / "b")
    (src / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match="model_v0_backup"):
        back, _ = load_model_for_inference(import_hf(src, tmp_path / "c"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"lists shard\(s\) that are missing: \['model-00002-of-00002.safetensors'\]"
    ):
        import_hf(src, tmp_path / "d")
    (src / "model.safetensors.index.json").unlink()
    with pytest.raises(
        FileNotFoundError,
        match="has no model.safetensors nor model.safetensors.index.json; it has "
        r"\['model-00001-of-00002.safetensors', 'model_v0_backup.safetensors'\]",
    ):
        import_hf(src, tmp_path / "e")


def test_corrupted_sources_are_one_line_errors_naming_the_file(exported, tmp_path, capsys):
    import shutil

    _, out, _ = exported
    trunc = tmp_path / "trunc"
    shutil.copytree(out, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert cli_main(["import", "hf", str(trunc), str(tmp_path / "o1")]) == 1  # was a SafetensorError traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"weight file '{trunc / 'model.safetensors'}' is truncated or corrupted" in err
    (trunc / "config.json").write_text("{not json")
    assert cli_main(["import", "hf", str(trunc), str(tmp_path / "o2")]) == 2
    assert f"config file '{trunc / 'config.json'}' is not valid JSON" in capsys.readouterr().err
    # a GGUF with a valid magic and garbage after it (was: "config file is not a valid JSON file")
    import struct

    gguf = tmp_path / "g" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + b"junk" * 50)
    assert cli_main(["import", "hf", str(gguf), str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: GGUF file '{gguf}' could not be loaded") and "truncated, corrupted" in err
    gguf.write_bytes(b"PK\x03\x04 not a gguf")
    assert cli_main(["import", "hf", str(gguf), str(tmp_path / "o4")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_export_and_import_never_overwrite_a_training_checkpoint_or_run(tmp_path, capsys):
    from looplm.checkpoint_io import load_model_for_inference, verify_checkpoint
    from looplm.train.checkpoint import save_checkpoint

    model = _perturb(looplm.build("tiny-llama"))
    ckpt = write_checkpoint(tmp_path / "ckpt", model, ByteTokenizer())
    # export hf --overwrite into a looplm checkpoint used to replace its model.safetensors / config.json
    assert cli_main(["export", "hf", str(ckpt), str(ckpt), "--overwrite"]) == 2
    assert "holds a looplm checkpoint; an export into it would overwrite" in capsys.readouterr().err
    verify_checkpoint(ckpt)
    load_model_for_inference(ckpt)
    run = tmp_path / "run"
    record = {
        "model": model.config.to_dict(),
        "tokenizer": "byte",
        "tokenizer_fingerprint": ByteTokenizer().fingerprint(),
    }
    step = save_checkpoint(run / "ckpt", 2, model, None, {"step": 2}, record)
    (run / "metrics.jsonl").write_text("{}\n")
    for target, what in ((run, "training run"), (step, "training checkpoint")):
        assert cli_main(["export", "hf", str(ckpt), str(target), "--overwrite"]) == 2
        assert f"holds a looplm {what}" in capsys.readouterr().err
    hf = export_hf(model, tmp_path / "hf", tokenizer="byte")
    export_hf(model, hf, tokenizer="byte", overwrite=True)  # over an earlier export: what --overwrite is for
    with pytest.raises(FileExistsError, match="holds a looplm training checkpoint; writing a checkpoint over it"):
        import_hf(hf, step, overwrite=True)
    import_hf(hf, ckpt, overwrite=True)  # over an earlier import / written checkpoint: allowed
    verify_checkpoint(step)


# ------------------------------------------------------------------------------------------ what tools read
def test_config_json_has_the_fields_tools_read(tmp_path):
    from helpers import tiny_variant

    cfg = tiny_variant("stateloop-410m-k5")
    torch.manual_seed(0)
    model = _perturb(looplm.build(cfg))
    out = export_hf(model, tmp_path / "sl", tokenizer="byte")
    c = json.loads((out / "config.json").read_text())
    p, s, K, co = cfg.n_prelude, cfg.n_core, cfg.n_loops, cfg.n_coda
    assert (c["num_prelude_layers"], c["num_core_layers"], c["trained_num_loops"], c["num_coda_layers"]) == (
        p,
        s,
        K,
        co,
    )
    assert (
        c["num_loops"] == K
        and c["num_hidden_layers"] == p + s + co
        and c["effective_num_hidden_layers"] == p + s * K + co
    )
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
        cfg.attention.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
    )
    assert (c["hidden_size"], c["intermediate_size"], c["vocab_size"]) == (cfg.d_model, cfg.d_ff, cfg.vocab_size)
    assert c["rms_norm_eps"] == cfg.norm_eps and c["rope_theta"] == cfg.attention.rope_theta
    assert c["max_position_embeddings"] == cfg.max_seq_len and c["looplm"]["rule"]["name"] == "stateloop"
    assert c["exit_threshold"] is None and len(c["layer_types"]) == p + s + co
    # another inference loop count moves the effective depth; generate(num_loops=...) still overrides it
    deep = json.loads(
        (export_hf(model, tmp_path / "deep", tokenizer="byte", num_loops=K + 2) / "config.json").read_text()
    )
    assert deep["num_loops"] == K + 2 and deep["effective_num_hidden_layers"] == p + s * (K + 2) + co
    # an exit gate writes its threshold at the top level; a pause model counts real tokens
    gate = looplm.build(
        "tiny-llama", overrides={"rule.name": "exit_gate", "rule.options": {"threshold": 0.7}, "n_loops": 3}
    )
    assert (
        json.loads((export_hf(gate, tmp_path / "gate", tokenizer="byte") / "config.json").read_text())["exit_threshold"]
        == 0.7
    )
    pause = looplm.build("tiny-llama", overrides={"pause": {"n_pause": 3}})
    pc = json.loads((export_hf(pause, tmp_path / "pause", tokenizer="byte") / "config.json").read_text())
    assert pc["max_position_embeddings"] == pause.config.max_seq_len // 4


def test_hidden_states_in_transformers_layout(tmp_path):
    """An imported Llama's export returns transformers' own hidden states; a looped one 1 + p + s·r + c of them."""
    hf = _tiny_hf("llama").eval()
    hf.save_pretrained(str(tmp_path / "llama"))
    _byte_hf_tokenizer(tmp_path / "llama")
    out = export_hf(import_hf(tmp_path / "llama", tmp_path / "ckpt"), tmp_path / "hf")
    ex = _load(out)
    ids = _prompt(8, vocab=256)
    with torch.no_grad():
        want, got = hf(ids, output_hidden_states=True).hidden_states, ex(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    model = _perturb(looplm.build("tiny-coreloop"))
    ex = _load(export_hf(model, tmp_path / "loop", tokenizer="byte"))
    cfg = model.config
    with torch.no_grad():
        hs = ex(ids, output_hidden_states=True, num_loops=5).hidden_states
        ref = model(ids, output_hidden=True, output_iterations=True, num_loops=5)
    assert len(hs) == 1 + cfg.n_prelude + cfg.n_core * 5 + cfg.n_coda
    assert torch.equal(hs[0], model.embed(ids) * model.embed_multiplier) and torch.equal(hs[-1], ref.hidden)
    for k in range(5):  # the last core block's output at iteration k is H^k
        assert torch.equal(hs[cfg.n_prelude + cfg.n_core * (k + 1)], ref.iterations[k])


def test_incomplete_export_is_refused(exported, tmp_path):
    """A tensor missing from the safetensors would be uninitialised memory (values up to 1e30, NaN): refused."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _, out, _ = exported
    broken = shutil.copytree(out, tmp_path / "broken")
    sd = load_file(str(broken / "model.safetensors"))
    gone = "looplm.core.stack.blocks.0.mlp.up_proj.weight"
    assert gone in sd
    del sd[gone]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*core\.stack\.blocks\.0\.mlp\.up_proj\.weight.*uninitialised"):
        AutoModelForCausalLM.from_pretrained(str(broken), trust_remote_code=True)
    sd[gone] = torch.zeros(1)
    sd["looplm.not_a_tensor_of_the_model"] = torch.zeros(2)
    del sd[gone]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not the model's.*not_a_tensor_of_the_model"):
        AutoModelForCausalLM.from_pretrained(str(broken), trust_remote_code=True)


# ------------------------------------------------------------------------------------------ generate()
def _spy(hf):
    """Count the calls of the lean path (looplm's generate behind the export's generate())."""
    import dataclasses
    import functools

    calls = []
    impl = hf.looplm_implementation

    @functools.wraps(impl.generate)  # its signature: the export passes the arguments looplm's generate takes
    def lean(*a, **kw):
        calls.append(kw)
        return impl.generate(*a, **kw)

    hf.looplm_implementation = dataclasses.replace(impl, generate=lean)
    return calls


def test_generate_takes_the_lean_path_with_transformers_tokens(exported):
    model, out, _ = exported
    hf = _load(out)
    calls = _spy(hf)
    a, b = _prompt(9, seed=2)[0], _prompt(4, seed=3)[0]
    batch = torch.full((2, 9), hf.config.pad_token_id)
    batch[0], batch[1, 5:] = a, b
    mask = (torch.arange(9)[None] >= torch.tensor([[0], [5]])).long()
    loop = transformers.GenerationMixin.generate  # transformers' own loop over forward()
    for kw in (
        {"do_sample": False},
        {"do_sample": True, "top_k": 7},
        {"do_sample": True, "top_p": 0.8, "temperature": 0.7},
        {"do_sample": False, "eos_token_id": int(batch[0, 3])},
        {"do_sample": False, "num_loops": 5},
    ):
        torch.manual_seed(1)
        lean = hf.generate(batch, attention_mask=mask, max_new_tokens=6, **kw)
        torch.manual_seed(1)
        assert torch.equal(lean, loop(hf, batch, attention_mask=mask, max_new_tokens=6, **kw)), kw
    assert len(calls) == 5 and calls[-1]["num_loops"] == 5 and calls[0]["attention_mask"] is not None
    # looplm's own generate options pass straight through (here: its sampling generator)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ids = _prompt(5)
    assert torch.equal(
        hf.generate(ids, max_new_tokens=5, do_sample=True, generator=g1),
        model.generate(ids, max_new_tokens=5, do_sample=True, top_k=50, generator=g2),
    )
    # what only transformers' loop does goes there (its cache preallocated for the whole request)
    n = len(calls)
    beams = hf.generate(ids, max_new_tokens=4, num_beams=2, return_dict_in_generate=True)
    cache = beams["cache"] if "cache" in beams else beams["past_key_values"]
    assert cache.inner.capacity == 5 + 4
    hf.generate(ids, max_new_tokens=4, repetition_penalty=1.3)
    assert len(calls) == n
    with pytest.raises(ValueError, match="num_loop"):  # a misspelt argument: transformers' own error
        hf.generate(ids, max_new_tokens=2, num_loop=3)


def test_generate_refuses_too_long_a_request_before_decoding(exported):
    _, out, _ = exported
    hf = _load(out)
    steps = []
    hook = hf.looplm.register_forward_hook(lambda *a: steps.append(1))
    limit = hf.looplm.config.max_seq_len
    ids = _prompt(5)
    for kw in ({}, {"num_beams": 2}):  # the lean path and transformers' loop alike
        with pytest.raises(ValueError, match=rf"prompt length 5 \+ {limit} new tokens exceeds .* at most {limit - 5}"):
            hf.generate(ids, max_new_tokens=limit, **kw)
    hook.remove()
    assert steps == []


# ------------------------------------------------------------------------------------------ tokenizer
def _chat_source(path):
    """A tiny Llama with a BPE tokenizer that has a chat template and named special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["the user asks and the assistant answers in a loop"] * 50,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    chat = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=chat,
    )
    fast.save_pretrained(str(path))
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return fast


def test_chat_template_and_special_tokens_survive_import_and_export(tmp_path):
    from transformers import AutoTokenizer, pipeline

    src = _chat_source(tmp_path / "src")
    ckpt = import_hf(tmp_path / "src", tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    # no custom code runs for the tokenizer (transformers 5 still reads config.json: say so to skip its question)
    tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    msgs = [{"role": "user", "content": "the loop asks"}]
    assert tok.chat_template == src.chat_template
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == src.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
    )
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "local_files_only" not in cfg and "auto_map" not in cfg
    pipe = pipeline("text-generation", model=str(out), trust_remote_code=True)
    res = pipe(msgs, max_new_tokens=3, do_sample=False)
    assert res[0]["generated_text"][-1]["role"] == "assistant"


# ------------------------------------------------------------------------------------------ checkpoints
def test_import_stores_a_tied_head_once_and_loads_on_meta(tmp_path):
    from safetensors import safe_open

    from looplm.checkpoint_io import load_model_for_inference

    hf = _tiny_hf("qwen3").eval()  # tie_word_embeddings
    hf.save_pretrained(str(tmp_path / "q"))
    _byte_hf_tokenizer(tmp_path / "q")
    ckpt = import_hf(tmp_path / "q", tmp_path / "ckpt")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "embed.weight" in keys and "lm_head.weight" not in keys
    model, _ = load_model_for_inference(ckpt)
    assert model.lm_head.weight is model.embed.weight  # tied again after the assign-load
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert model.embed.weight._no_muon and model.num_params() == sum(p.numel() for p in hf.parameters())
    ids = _prompt(8, vocab=256)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)
    # `train.init_from` on it fills the tied head from the embedding
    from looplm.train.trainer import _load_init_weights

    fresh = looplm.build(model.config)
    _load_init_weights(fresh, str(ckpt))
    assert torch.equal(fresh.lm_head.weight, hf.lm_head.weight.detach())
