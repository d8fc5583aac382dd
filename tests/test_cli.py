"""`looplm presets`, `looplm info`, `looplm generate` (in-process, plus one real subprocess)."""

import json
import subprocess
import sys
import time

import pytest

from looplm.cli import main


def test_presets_lists_paper_models(capsys):
    assert main(["presets", "--json"]) == 0
    names = json.loads(capsys.readouterr().out)
    for n in ["llama3.1-1b", "qwen3-0.6b-baseloop-4x7", "stateloop-1.4b-vanilla", "mamba2-140m-loop4", "llama2-6x4", "tiny-llama"]:
        assert n in names
    assert main(["presets"]) == 0
    assert "Qwen3-0.6B BaseLoop 4x7" in capsys.readouterr().out


def test_info_json_fields(capsys):
    assert main(["info", "qwen3-0.6b-baseloop-4x7", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"] == 218_507_264
    assert info["physical_depth"] == 4 and info["effective_depth"] == 28
    assert info["embedding_params"] == 151936 * 1024  # tied: counted once
    assert info["params"] == info["embedding_params"] + info["non_embedding_params"]
    assert info["forward_flops_per_token"] > 2 * info["non_embedding_params"]


def test_info_flops_scale_with_loops(capsys):
    main(["info", "llama2-6x4", "--json", "--seq-len", "1"])
    a = json.loads(capsys.readouterr().out)
    main(["info", "llama2-24x1", "--json", "--seq-len", "1"])
    b = json.loads(capsys.readouterr().out)
    assert a["forward_flops_per_token"] == b["forward_flops_per_token"]  # iso-FLOPs
    assert a["params"] < b["params"]
    main(["info", "llama2-6x4", "--json", "--loops", "8"])
    assert json.loads(capsys.readouterr().out)["effective_depth"] == 48


def test_info_with_overrides_and_yaml(tmp_path, capsys):
    assert main(["info", "tiny-llama", "--set", "n_loops=6", "--set", "attention.n_kv_heads=4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["effective_depth"] == 12
    y = tmp_path / "m.yaml"
    y.write_text("vocab_size: 100\nd_model: 32\nn_prelude: 1\nn_core: 2\nn_loops: 2\nn_coda: 1\nd_ff: 64\nattention: {n_heads: 2}\n")
    assert main(["info", str(y), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["p_s_K_c"] == [1, 2, 2, 1]


def test_info_reports_config_errors(capsys):
    assert main(["info", "tiny-llama", "--set", "n_loops=0", "--set", "d_modle=3"]) == 2
    err = capsys.readouterr().err
    assert "n_loops" in err and "d_modle" in err and "did you mean 'd_model'" in err


def test_generate_from_random_preset(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5"]) == 0


def test_info_is_fast_for_the_largest_presets():
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "looplm.cli", "info", "stateloop-1.4b-vanilla-ffn", "--json"],
                         capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - t
    assert json.loads(out.stdout)["params"] == 1_467_222_016
    assert elapsed < 15  # < 5 s on an idle machine; generous under a loaded test run
