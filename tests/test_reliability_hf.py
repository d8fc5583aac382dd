"""Bad inputs to ``looplm import hf`` / ``export hf`` and to checkpoint loading: each is refused before any work,
in one line naming the file, field or tensor and what to do — never a raw exception, a prompt, a hang or an
allocation the machine cannot make."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import looplm
from looplm.checkpoint_io import CheckpointError, load_model_for_inference
from looplm.cli import main as cli_main
from looplm.factory import ModelTooLargeError
from looplm.hf.importer import MAX_IMPORT_LOOPS, import_hf
from looplm.hf.public import PublicFormatError, _freqs_cis, export_original

from test_public_models import write_huginn, write_ouro

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_line_error(capsys, argv, rc=None) -> str:
    capsys.readouterr()  # what writing the sources printed (transformers' progress bars)
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert code != 0 and (rc is None or code == rc), (code, err)
    # one line, or one per problem ("  - ...") for a ConfigError / PublicFormatError listing several
    lines = err.rstrip("\n").split("\n")
    assert lines[0].startswith("error: ") and all(ln.startswith("  - ") for ln in lines[1:]), err
    assert "Traceback" not in err, err
    return err


def _tiny_llama_dir(d: Path, **cfg_edits) -> Path:
    import transformers

    from looplm.data.tokenizers import ByteTokenizer
    from looplm.hf.tokenizer import to_pretrained_tokenizer_fast

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(d))
    to_pretrained_tokenizer_fast(ByteTokenizer()).save_pretrained(str(d))
    if cfg_edits:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, **cfg_edits}))
    return d


# ------------------------------------------------------------------------------ 1. output = source
def test_import_into_its_own_source_is_refused_and_the_source_kept(tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "S")
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    err = _one_line_error(capsys, ["import", "hf", str(src), str(src), "--overwrite"], rc=2)
    assert "is the source" in err and "pick a directory outside it" in err
    for out in (src / "sub", src / "sub" / "deeper"):
        with pytest.raises(ValueError, match="is inside the source"):
            import_hf(src, out, overwrite=True)
    link = tmp_path / "link"
    link.symlink_to(src)  # the same directory under another name
    with pytest.raises(ValueError, match="is the source"):
        import_hf(src, link, overwrite=True)
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
    assert not (src / "sub").exists()
    # export: neither into the checkpoint it reads (looplm_contents) nor inside it
    run = import_hf(src, tmp_path / "run")
    err = _one_line_error(capsys, ["export", "hf", str(run), str(run / "hf"), "--format", "original"], rc=2)
    assert "is inside the source" in err and not (run / "hf").exists()


# ------------------------------------------------------------------------------ 2. tokenizer code
@pytest.mark.parametrize("family", ["ouro", "llama"])
def test_tokenizer_auto_map_naming_code_is_refused_without_a_prompt(family, tmp_path, monkeypatch):
    src = write_ouro(tmp_path / "s")[0] if family == "ouro" else _tiny_llama_dir(tmp_path / "s")
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    ran = tmp_path / "ran"
    (src / "tokenization_evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")

    def no_prompt(*a, **k):
        raise AssertionError("transformers asked whether to run the tokenizer's code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    with pytest.raises(ValueError) as e:
        import_hf(src, tmp_path / "out")
    msg = str(e.value)
    assert "tokenizer_config.json" in msg and "'tokenization_evil.EvilTokenizer'" in msg and "AutoTokenizer" in msg
    assert str(src / "tokenization_evil.py") in msg and "remove auto_map" in msg
    assert not ran.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ 3. portable tokenizer config
def test_imported_tokenizer_config_names_a_class_transformers_4_has(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src, _, _ = write_ouro(tmp_path / "o")
    run = import_hf(src, tmp_path / "run")
    orig = export_original(run, tmp_path / "orig")
    for d in (run / "tokenizer", orig):
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        # transformers 5 writes TokenizersBackend here, which 4.x (pyproject allows >= 4.46) cannot import
        assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast", d
        assert "auto_map" not in cfg
        tok = AutoTokenizer.from_pretrained(str(d))
        assert isinstance(tok, PreTrainedTokenizerFast) and tok("abc")["input_ids"] == [97, 98, 99]
    from looplm.hf.export import export_hf

    hf = export_hf(run, tmp_path / "hf")  # a looplm export of the import: the same class
    assert json.loads((hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert PreTrainedTokenizerFast.from_pretrained(str(hf))("abc")["input_ids"] == [97, 98, 99]


# ------------------------------------------------------------------------------ 4. tokenizer.json
def test_garbage_or_symlinked_tokenizer_json_is_named(tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "o")
    good = (src / "tokenizer.json").read_bytes()
    tj = src / "tokenizer.json"
    tj.write_text('{"version": "1.0", "model": 42}')
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o1")], rc=2)
    assert f"tokenizer file '{tj}'" in err and "is not a tokenizer the tokenizers library can read" in err
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(b"\x00\x01 garbage")
    tj.unlink()
    tj.symlink_to(outside)
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o2")], rc=2)
    assert f"'{tj}' (a symlink to '{outside}')" in err
    outside.unlink()  # a dangling link
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o3")], rc=2)
    assert f"'{tj}' (a symlink to '{outside}') does not exist" in err
    outside.write_bytes(good)  # a link to a good file (Hugging Face's cache links into its blob store): loads
    import_hf(src, tmp_path / "o4")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


# ------------------------------------------------------------------------------ 5. deep JSON
def test_deeply_nested_json_is_named_not_a_recursion_error(tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    src, cfg, _ = write_ouro(tmp_path / "o")
    (src / "config.json").write_text(json.dumps({**cfg, "layer_types": "X"}).replace('"X"', deep))
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o1")], rc=2)
    assert "config.json" in err and "nests" in err
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer_config.json").write_text('{"a": ' + deep + "}")
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o2")], rc=2)
    assert f"tokenizer file '{src / 'tokenizer_config.json'}' nests" in err
    llama = _tiny_llama_dir(tmp_path / "l")
    (llama / "config.json").write_text('{"model_type": "llama", "x": ' + deep + "}")
    err = _one_line_error(capsys, ["import", "hf", str(llama), str(tmp_path / "o3")], rc=2)
    assert f"config file '{llama / 'config.json'}' nests" in err
    # a checkpoint's own config.json, at load
    run = import_hf(write_ouro(tmp_path / "o4")[0], tmp_path / "run")
    (run / "config.json").write_text('{"model": ' + deep + "}")
    with pytest.raises(CheckpointError, match="nests"):
        load_model_for_inference(run, verify=False)


# ------------------------------------------------------------------------------ 6. integer fields
def test_bad_integer_sizes_are_named_before_building(tmp_path, capsys):
    src = _tiny_llama_dir(tmp_path / "l", num_hidden_layers=-2, num_attention_heads=0)
    capsys.readouterr()
    err = cli_main(["import", "hf", str(src), str(tmp_path / "o1")])
    text = capsys.readouterr().err
    assert err == 2 and "num_hidden_layers: must be a positive integer, got -2" in text
    assert "num_attention_heads: must be a positive integer, got 0" in text and "unexpected" not in text
    o, cfg, _ = write_ouro(tmp_path / "o")
    (o / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0, "total_ut_steps": 0}))
    with pytest.raises(PublicFormatError) as e:  # was ZeroDivisionError
        import_hf(o, tmp_path / "o2")
    assert "num_attention_heads must be a positive integer, got 0" in str(e.value)
    assert "total_ut_steps must be a positive integer, got 0" in str(e.value)
    (o / "config.json").write_text(json.dumps({**cfg, "layer_types": 3}))
    with pytest.raises(PublicFormatError, match="layer_types must be a list"):  # was TypeError: len() of an int
        import_hf(o, tmp_path / "o3")


# ------------------------------------------------------------------------------ 7. NaN / inf weights
def test_nonfinite_weights_are_refused_at_import_and_at_load(tmp_path, capsys, monkeypatch):
    src, _, _ = write_ouro(tmp_path / "o")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    sd["model.norm.weight"][0] = float("inf")
    save_file(sd, str(src / "model.safetensors"))
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "run")], rc=1)
    assert "NaN or infinite values in 2 tensor(s)" in err and "core.stack.blocks.1.mlp.up_proj.weight" in err
    assert "norm.weight" in err and "--allow-nonfinite" in err and not (tmp_path / "run").exists()
    assert cli_main(["import", "hf", str(src), str(tmp_path / "run"), "--allow-nonfinite"]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, ["generate", "--checkpoint", str(tmp_path / "run"), "--max-new-tokens", "2"], rc=1)
    assert "NaN or infinite values in 2 tensor(s)" in err
    model, _ = load_model_for_inference(tmp_path / "run", allow_nonfinite=True)
    assert not torch.isfinite(model.norm.weight).all()
    monkeypatch.setenv("LOOPLM_ALLOW_NONFINITE", "1")  # the lm-eval model (no flags of its own) reads the environment
    load_model_for_inference(tmp_path / "run")
    monkeypatch.delenv("LOOPLM_ALLOW_NONFINITE")
    # eval ppl / threshold and serve / chat take the flag too
    err = _one_line_error(capsys, ["eval", "ppl", str(tmp_path / "run"), "--data", "stdlib", "--batches", "1"], rc=1)
    assert "NaN or infinite values in 2 tensor(s)" in err
    from looplm.serve.cli import load_served_model
    import argparse

    ns = dict(
        model=str(tmp_path / "run"), tokenizer=None, set=None, threads=None, seed=0, dtype="fp32", allow_deep=False
    )
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        load_served_model(argparse.Namespace(**ns, allow_nonfinite=False))
    assert not torch.isfinite(load_served_model(argparse.Namespace(**ns, allow_nonfinite=True))[0].norm.weight).all()
    # a finite fp32 weight that overflows when cast to fp16 is caught after the cast
    src2, _, _ = write_ouro(tmp_path / "o2")
    sd = load_file(str(src2 / "model.safetensors"))
    sd["lm_head.weight"][0, 0] = 1e6
    save_file(sd, str(src2 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) \(lm_head.weight\)"):
        import_hf(src2, tmp_path / "half", dtype="float16")


# ------------------------------------------------------------------------------ 8. impossible sizes
def test_impossible_sizes_are_refused_before_any_allocation(tmp_path, capsys, monkeypatch):
    src, cfg, _ = write_ouro(tmp_path / "o")
    (src / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10**12}))
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o1")], rc=2)
    assert "GiB for its parameters alone" in err and "GiB of memory available" in err and "--allow-large" in err
    (src / "config.json").write_text(json.dumps({**cfg, "total_ut_steps": 10**9}))
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "o2")], rc=2)
    assert "total_ut_steps = 1,000,000,000 loops" in err and "--allow-deep" in err
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"n_loops = 5,000 \(--set\)"):
        import_hf(src, tmp_path / "o3", n_loops=5000)
    (src / "config.json").write_text(json.dumps({**cfg, "total_ut_steps": MAX_IMPORT_LOOPS + 1}))
    run = import_hf(src, tmp_path / "deep", allow_deep=True)  # asked for explicitly
    assert json.loads((run / "config.json").read_text())["model"]["n_loops"] == MAX_IMPORT_LOOPS + 1
    # ... and a checkpoint that already holds such a config is refused at load, by every command, unless asked
    from looplm.checkpoint_io import CheckpointError, load_model_for_inference

    with pytest.raises(CheckpointError, match=r"n_loops = 4,097 loops, more than 4,096 .*LOOPLM_ALLOW_DEEP=1"):
        load_model_for_inference(run)
    assert load_model_for_inference(run, allow_deep=True)[0].config.n_loops == MAX_IMPORT_LOOPS + 1
    err = _one_line_error(capsys, ["generate", "--checkpoint", str(run), "--max-new-tokens", "1"], rc=1)
    assert "n_loops = 4,097 loops" in err and "--allow-deep" in err
    err = _one_line_error(capsys, ["generate", "--model", "tiny-llama", "--set", "n_loops=1000000000"], rc=1)
    assert "model 'tiny-llama': n_loops = 1,000,000,000 loops" in err
    h, hcfg, _ = write_huginn(tmp_path / "h")
    (h / "config.json").write_text(json.dumps({**hcfg, "mean_recurrence": 10**6}))
    with pytest.raises(ValueError, match="mean_recurrence = 1,000,000 loops"):
        import_hf(h, tmp_path / "o4")
    llama = _tiny_llama_dir(tmp_path / "l", vocab_size=10**12)
    err = _one_line_error(capsys, ["import", "hf", str(llama), str(tmp_path / "o5")], rc=2)
    assert "GiB for its parameters alone" in err
    # the factory's build path: a preset with an impossible vocabulary, and the override
    with pytest.raises(ModelTooLargeError, match="GiB for its parameters alone"):
        looplm.build("tiny-llama", vocab_size=10**12)
    monkeypatch.setattr("looplm.factory.available_memory", lambda: 1000)
    with pytest.raises(ModelTooLargeError, match="0.0 GiB of memory available"):
        looplm.build("tiny-llama")
    monkeypatch.setenv("LOOPLM_ALLOW_LARGE", "1")
    looplm.build("tiny-llama")
    looplm.build("tiny-llama", vocab_size=10**12, device="meta")  # the meta device takes no memory
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


# ------------------------------------------------------------------------------ 9. Huginn's stored RoPE table
def test_huginn_bf16_rope_table_warns_with_the_measured_difference(tmp_path):
    import warnings

    src, _, _ = write_huginn(tmp_path / "h")
    run = import_hf(src, tmp_path / "run")
    orig = export_original(run, tmp_path / "orig")  # the original format, its fp32 freqs_cis
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        import_hf(orig, tmp_path / "back32")
    assert not [w for w in seen if "freqs_cis" in str(w.message)]
    sd = load_file(str(orig / "model.safetensors"))
    table = sd["freqs_cis"]
    sd["freqs_cis"] = table.to(torch.bfloat16)  # as a release stores it
    save_file(sd, str(orig / "model.safetensors"))
    cfg = json.loads((orig / "config.json").read_text())
    expected = (
        (
            table.to(torch.bfloat16).float()
            - _freqs_cis(cfg["n_embd"] // cfg["num_attention_heads"], cfg["block_size"], cfg["rope_base"])
        )
        .abs()
        .max()
        .item()
    )
    assert expected > 1e-4
    with pytest.warns(UserWarning, match=r"freqs_cis \(bfloat16, 64 positions\) differs from the fp32 table") as w:
        import_hf(orig, tmp_path / "back16")
    assert f"by up to {expected:.3g}" in str(w[0].message)


# ------------------------------------------------------------------------------ 10. more bad inputs
def test_corrupted_checkpoint_manifest_and_config_are_named(tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "o")
    run = import_hf(src, tmp_path / "run")
    manifest = json.loads((run / "COMPLETE").read_text())
    (run / "COMPLETE").write_text(json.dumps({**manifest, "files": {"model.safetensors": "big"}}))
    err = _one_line_error(capsys, ["generate", "--checkpoint", str(run), "--max-new-tokens", "1"], rc=1)
    assert "COMPLETE" in err and "model.safetensors" in err  # was TypeError: string indices
    (run / "COMPLETE").write_text(json.dumps(manifest))
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "model": [1, 2]}))
    with pytest.raises(CheckpointError, match="has no model config"):  # was AttributeError: 'list' has no 'get'
        load_model_for_inference(run)


def test_config_values_that_load_but_mean_nothing_are_named(tmp_path, capsys):
    h, hcfg, _ = write_huginn(tmp_path / "h")
    for edit, says in (
        ({"rope_base": float("inf")}, "rope_theta: must be a finite number > 0, got inf"),
        ({"norm_eps": float("inf")}, "norm_eps: must be a finite number > 0, got inf"),
        ({"qk_bias": "yes"}, "qk_bias must be true or false, got 'yes'"),
    ):  # bool("no") is True too
        (h / "config.json").write_text(json.dumps({**hcfg, **edit}))
        with pytest.raises(PublicFormatError, match=says):  # inf, "yes": imported with exit 0 before
            import_hf(h, tmp_path / "out")
    o, ocfg, _ = write_ouro(tmp_path / "o")
    for edit, says in (
        ({"rope_scaling": "llama3"}, "rope_scaling 'llama3'"),  # was AttributeError: 'str' ... 'get'
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
    ):
        (o / "config.json").write_text(json.dumps({**ocfg, **edit}))
        with pytest.raises(PublicFormatError, match=says):
            import_hf(o, tmp_path / "out")
    llama = _tiny_llama_dir(tmp_path / "l", torch_dtype="float99", dtype="float99")
    err = _one_line_error(capsys, ["import", "hf", str(llama), str(tmp_path / "out")], rc=2)
    assert "dtype: must name a floating-point torch dtype" in err and "'float99'" in err  # was blamed on the tokenizer
    (o / "config.json").write_text(json.dumps(ocfg))
    run = import_hf(o, tmp_path / "run")
    with pytest.raises(ValueError, match="floating-point torch dtype"):  # an int8 export truncated every weight
        export_original(run, tmp_path / "e1", dtype="int8")
    from looplm.hf.export import export_hf

    with pytest.raises(ValueError, match="floating-point torch dtype"):
        export_hf(run, tmp_path / "e2", dtype="int8")
    assert not any((tmp_path / n).exists() for n in ("out", "e1", "e2"))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_import(tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "o", V=200)  # the byte tokenizer has 259 ids
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "run")], rc=2)
    assert "its tokenizer does not fit its model" in err and "259 ids" in err and "vocab_size is 200" in err
    assert not (tmp_path / "run").exists()  # was written, then refused by generate / eval / serve


def test_export_refuses_an_exit_threshold_outside_0_1(tmp_path, capsys):
    from looplm.data.tokenizers import ByteTokenizer
    from looplm.hf.importer import write_checkpoint

    model = looplm.build("tiny-llama", overrides={"rule.name": "exit_gate", "n_loops": 2})
    ckpt = write_checkpoint(tmp_path / "ckpt", model, ByteTokenizer())
    for q in ("nan", "1.5", "-0.1"):  # NaN was written into config.json, which is then not valid JSON
        err = _one_line_error(capsys, ["export", "hf", str(ckpt), str(tmp_path / "hf"), "--exit-threshold", q], rc=2)
        assert "exit_threshold must be a number in [0, 1]" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "file, edit",
    [
        ("tokenizer_config.json", {"eos_token": 5}),
        ("tokenizer_config.json", {"added_tokens_decoder": {"0": 1}}),
        ("special_tokens_map.json", {"eos_token": {"content": 5}}),
    ],
)
def test_tokenizer_fields_of_the_wrong_kind_are_named(file, edit, tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "o")
    path = src / file
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**old, **edit}))
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "run")], rc=2)  # was a raw TypeError
    assert f"{src}: cannot load it" in err and "the tokenizer could not be loaded (TypeError" in err
    assert not (tmp_path / "run").exists()


def test_dangling_symlinks_are_named_as_such(tmp_path, capsys):
    src, _, _ = write_ouro(tmp_path / "o")
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    (src / "model.safetensors").rename(blob)
    (src / "model.safetensors").symlink_to(blob)
    import_hf(src, tmp_path / "ok")  # a link to a file is read through (Hugging Face's cache layout)
    blob.unlink()
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "run")], rc=2)
    # was: "has no model.safetensors ...; it has ['model.safetensors'], which the format does not name"
    assert f"'{src / 'model.safetensors'}' is a symlink to '{blob}', which does not exist" in err
    cfg = src / "config.json"
    cfg.rename(tmp_path / "cfg.json")
    cfg.symlink_to(tmp_path / "gone.json")
    err = _one_line_error(capsys, ["import", "hf", str(src), str(tmp_path / "run")], rc=2)
    assert f"'{cfg}' is a symlink to" in err  # was: "has no config.json"
    assert not (tmp_path / "run").exists()
