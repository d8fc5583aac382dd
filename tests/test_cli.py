"""`looplm presets`, `looplm info`, `looplm generate` (in-process, plus two real subprocesses)."""

import json
import subprocess
import sys
import time
import warnings

import pytest
import torch

import looplm
from looplm.checkpoint_io import CheckpointWarning
from looplm.cli import main
from looplm.data.tokenizers import ByteTokenizer
from looplm.dataclass_util import to_dict
from looplm.train.checkpoint import save_checkpoint


def test_presets_lists_paper_models(capsys):
    assert main(["presets", "--json"]) == 0
    names = json.loads(capsys.readouterr().out)
    for n in [
        "llama3.1-1b",
        "qwen3-0.6b-baseloop-4x7",
        "stateloop-1.4b-vanilla",
        "mamba2-140m-loop4",
        "llama2-6x4",
        "tiny-llama",
    ]:
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
    y.write_text(
        "vocab_size: 100\nd_model: 32\nn_prelude: 1\nn_core: 2\nn_loops: 2\nn_coda: 1\nd_ff: 64\nattention: {n_heads: 2}\n"
    )
    assert main(["info", str(y), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["p_s_K_c"] == [1, 2, 2, 1]


def test_info_reports_config_errors(capsys):
    assert main(["info", "tiny-llama", "--set", "n_loops=0", "--set", "d_modle=3"]) == 2
    err = capsys.readouterr().err
    assert "n_loops" in err and "d_modle" in err and "did you mean 'd_model'" in err


def test_generate_from_random_preset(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    torch.manual_seed(0)  # the CLI built its random model right after conftest's manual_seed(0)
    model = looplm.build("tiny-llama")
    ids = model.generate(torch.tensor([list(b"Hello")]), max_new_tokens=5, do_sample=False, eos_token_id=256)
    assert printed == ByteTokenizer().decode(ids[0, 5:].tolist()) + "\n"


def test_generate_from_random_preset_is_reproducible(capsys):
    """--seed fixes a random preset's weights too: the same text whatever the process did before."""
    argv = ["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "8", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    torch.rand(1000)  # move the global generator on
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_generate_dtype_bf16_decodes_bf16_weights(capsys, monkeypatch):
    from looplm.model import LoopedLM

    seen, real = [], LoopedLM.generate
    monkeypatch.setattr(
        LoopedLM, "generate", lambda self, *a, **k: seen.append(self.embed.weight.dtype) or real(self, *a, **k)
    )
    assert (
        main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5", "--dtype", "bf16"])
        == 0
    )
    printed = capsys.readouterr().out
    assert seen == [torch.bfloat16]
    torch.manual_seed(0)
    model = looplm.build("tiny-llama").to(torch.bfloat16)
    ids = model.generate(torch.tensor([list(b"Hello")]), max_new_tokens=5, do_sample=False, eos_token_id=256)
    assert printed == ByteTokenizer().decode(ids[0, 5:].tolist()) + "\n"


def test_generate_compile_flag_compiles_the_blocks_and_decodes_the_same(capsys, monkeypatch):
    import looplm.parallel as parallel

    compiled = []
    real = parallel.compile_blocks

    def eager_backend(model, **kw):  # dynamo's tracing without inductor's minutes of codegen in a test
        compiled.append(model)
        real(model, backend="eager")

    monkeypatch.setattr(parallel, "compile_blocks", eager_backend)
    torch._dynamo.reset()
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "5", "--compile"]) == 0
    printed = capsys.readouterr().out
    assert len(compiled) == 1
    torch.manual_seed(0)
    model = looplm.build("tiny-llama")
    ids = model.generate(torch.tensor([list(b"Hello")]), max_new_tokens=5, do_sample=False, eos_token_id=256)
    assert printed == ByteTokenizer().decode(ids[0, 5:].tolist()) + "\n"


# ------------------------------------------------------------------------------------ generate --checkpoint
@pytest.fixture
def tiny_run(tmp_path):
    """A run directory with one checkpoint of a random tiny-llama (max_seq_len 16), trained with 'byte'."""
    torch.manual_seed(1)
    model = looplm.build("tiny-llama", max_seq_len=16)
    run = tmp_path / "run"
    record = {
        "model": to_dict(model.config),
        "tokenizer": "byte",
        "tokenizer_fingerprint": ByteTokenizer().fingerprint(),
    }
    save_checkpoint(run / "ckpt", 3, model, None, {"step": 3}, record)
    return run, model


def _generate(run, capsys, *args):
    rc = main(["generate", "--checkpoint", str(run), "--prompt", "abc", "--max-new-tokens", "4", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _greedy(model, prompt: bytes, n: int, **kw) -> str:
    ids = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, eos_token_id=256, **kw)
    return ByteTokenizer().decode(ids[0, len(prompt) :].tolist())


def test_generate_from_a_checkpoint_decodes_its_weights(tiny_run, capsys):
    run, model = tiny_run
    rc, out, err = _generate(run, capsys)
    assert rc == 0, err
    assert out == _greedy(model, b"abc", 4) + "\n"
    rc, out, _ = _generate(run, capsys, "--set", "n_loops=5")  # inference-time override: the default loop count
    assert rc == 0 and out == _greedy(model, b"abc", 4, num_loops=5) + "\n"


def test_generate_set_takes_inference_fields_only(tiny_run, capsys):
    run, _ = tiny_run
    long_prompt = "x" * 20  # longer than the trained max_seq_len of 16
    rc = main(["generate", "--checkpoint", str(run), "--prompt", long_prompt, "--max-new-tokens", "1"])
    assert rc == 2 and "max_seq_len=16" in capsys.readouterr().err
    rc = main(
        [
            "generate",
            "--checkpoint",
            str(run),
            "--prompt",
            long_prompt,
            "--max-new-tokens",
            "1",
            "--set",
            "max_seq_len=64",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc, out, err = _generate(run, capsys, "--set", "d_model=32", "--set", "rule.name=vanilla")
    assert rc == 2 and out == ""
    assert "d_model: cannot be changed on a trained checkpoint" in err and "rule.name: cannot be changed" in err
    assert "only max_seq_len, n_loops can be set" in err and "Traceback" not in err


def test_generate_tokenizer_override_warns_when_it_differs(tiny_run, tmp_path, capsys):
    from looplm.data.tokenizers import train_bpe

    run, _ = tiny_run
    bpe = train_bpe(None, 260, tmp_path / "tok", texts=["abc abd abe " * 20, "hello world"])  # fits vocab 260
    expected = (
        rf"fingerprint {bpe.fingerprint()}\) is not the one .* \('byte', fingerprint {ByteTokenizer().fingerprint()}\)"
    )
    with pytest.warns(CheckpointWarning, match=expected):
        rc, out, err = _generate(run, capsys, "--tokenizer", str(tmp_path / "tok"))
    assert rc == 0 and out.strip()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recorded tokenizer: no warning
        rc, out, err = _generate(run, capsys, "--tokenizer", "byte")
    assert rc == 0


def test_generate_without_a_checkpoint_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    rc = main(["generate", "--checkpoint", str(tmp_path / "empty_run")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and "holds no complete checkpoint" in err
    rc = main(["generate", "--checkpoint", str(tmp_path / "missing")])
    assert rc == 1 and "does not exist" in capsys.readouterr().err


def test_generate_and_eval_do_not_import_the_training_code(tiny_run, tmp_path):
    run, _ = tiny_run
    (tmp_path / "doc.txt").write_text("some text to score")
    code = (
        "import sys\n"
        "from looplm.cli import main\n"
        f"assert main(['generate', '--checkpoint', {str(run)!r}, '--max-new-tokens', '2']) == 0\n"
        f"assert main(['eval', 'ppl', {str(run)!r}, '--data', {str(tmp_path / 'doc.txt')!r}, '--seq-len', '8']) == 0\n"
        "print('TRAIN MODULES', sorted(m for m in sys.modules if m.startswith('looplm.train')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TRAIN MODULES []" in r.stdout


def test_empty_model_yaml_is_refused(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    assert main(["info", str(tmp_path / "empty.yaml")]) == 2
    err = capsys.readouterr().err
    assert "empty.yaml: the file is empty or holds only comments" in err
    assert main(["generate", "--model", str(tmp_path / "empty.yaml")]) == 2
    assert "holds only comments" in capsys.readouterr().err


def test_info_is_fast_for_the_largest_presets():
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "looplm.cli", "info", "stateloop-1.4b-vanilla-ffn", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - t
    assert json.loads(out.stdout)["params"] == 1_467_222_016
    assert elapsed < 15  # < 5 s on an idle machine; generous under a loaded test run


# ------------------------------------------------------------------------------------ bad arguments, refused up front
def test_task_eval_refuses_bad_counts_before_opening_the_run(tmp_path, capsys):
    # --count -1 was an IndexError, --count 0 silently the run's default
    assert (
        main(["task", "phop", "eval", str(tmp_path / "no-run"), "--count", "-1", "--loops", "0", "--thresholds", "2"])
        == 2
    )
    err = capsys.readouterr().err
    assert "invalid task eval arguments (3 problem(s))" in err and "count (--count): must be an integer >= 1" in err
    assert "--loops" in err and "--thresholds" in err and "no-run" not in err  # the run was not opened


def test_analyze_refuses_bad_counts_and_unknown_options(tmp_path, capsys):
    out = tmp_path / "an"
    argv = ["analyze", "--model", "tiny-llama", "--metrics", "angular-distance,skip-response", "--out", str(out)]
    assert main([*argv, "--batches", "0", "--loops", "0", "--option", "gird=prefix", "--option", "loops=2"]) == 2
    err = capsys.readouterr().err
    assert "--batches: must be >= 1, got 0" in err  # was a TypeError
    assert "--loops: must be >= 1, got 0" in err  # silently meant K
    assert (
        "--option gird: not read by angular-distance, skip-response (did you mean 'grid'?); they read: grid, lags"
        in err
    )
    assert "--option loops: set by the command line itself (use --loops)" in err  # an unknown --option was ignored
    assert not out.exists()


def test_bench_decode_refuses_bad_threads_and_devices(capsys):
    assert (
        main(["bench", "decode", "--threads", "-4", "--device", "cuda:9", "--runs", "0", "--models", "vanila-k4"]) == 2
    )
    err = capsys.readouterr().err  # were tracebacks from torch.set_num_threads and the CUDA runtime
    assert "--threads: must be >= 1, or 0 for torch's default, got -4" in err and "--device cuda:9:" in err
    assert "--runs: must be >= 1" in err and "--models: unknown model 'vanila-k4'; choose from vanilla-k4," in err
    assert main(["bench", "decode", "--device", "tpu"]) == 2
    assert "--device: 'tpu' is not a device; use auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main(["bench", "decode", "--device", "meta"]) == 2
    assert "--device meta: only cpu and cuda devices are supported" in capsys.readouterr().err


def test_a_checkpoint_without_its_complete_manifest_loads_with_a_warning(tiny_run, capsys):
    run, model = tiny_run
    step = run / "ckpt" / "step_000003"
    (step / "COMPLETE").unlink()  # written by hand, or interrupted between the rename and the manifest
    with pytest.warns(
        CheckpointWarning,
        match=rf"checkpoint '{step}' has no COMPLETE manifest, so its files cannot be "
        "verified .* loading it unverified",
    ):  # was silent
        rc, out, err = _generate(step, capsys)
    assert rc == 0 and out.strip() == _greedy(model, b"abc", 4).strip()


def _text(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("The loop runs again and again, over and over.\n" * 3)
    return str(f)


def test_eval_threshold_on_a_model_without_a_gate_says_what_it_runs(tiny_run, tmp_path, capsys):
    """No exit gate: the threshold sweep has nothing to apply q to — said on stderr; --thresholds is refused."""
    run, _ = tiny_run
    argv = ["eval", "threshold", str(run), "--data", _text(tmp_path), "--batches", "1", "--decode-batches", "0"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "note: this model's rule 'vanilla' has no exit gate, so there is no threshold sweep" in err
    assert "only the fixed-loop ablation r = 1..3 is run" in err and "| fixed | 3 |" in out
    assert main([*argv, "--thresholds", "0.5"]) == 2
    assert "--thresholds: a threshold q selects each token's exit from the learned exit gate" in capsys.readouterr().err


def test_eval_ppl_refuses_bad_counts_before_reading_the_checkpoint(tmp_path, capsys):
    # --batch-size 0 was a ZeroDivisionError, --seq-len 0 silently the default
    argv = ["eval", "ppl", str(tmp_path / "no-run"), "--data", "stdlib"]
    assert main([*argv, "--batch-size", "0", "--seq-len", "0", "--batches", "-1"]) == 2
    err = capsys.readouterr().err
    assert "invalid eval ppl arguments (3 problem(s))" in err and "--batch-size: must be an integer >= 1, got 0" in err
    assert "--seq-len: must be an integer >= 2, got 0" in err and "no-run" not in err  # the checkpoint was not read


def test_eval_ppl_refuses_a_window_longer_than_the_model(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    assert main(["eval", "ppl", str(run), "--data", _text(tmp_path), "--seq-len", "17"]) == 2
    assert "--seq-len 17 exceeds the model's max_seq_len=16; give at most 16" in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_named(tiny_run, tmp_path, capsys):
    """--out naming an existing file was '[Errno 17] File exists' (eval ppl's depth sweep: refused before any work)."""
    run, _ = tiny_run
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["eval", "ppl", str(run), "--data", _text(tmp_path), "--loops", "1..2", "--out", str(f)]) == 2
    assert f"--out {str(f)!r}: exists and is not a directory" in capsys.readouterr().err
    assert (
        main(
            [
                "analyze",
                "--model",
                "tiny-llama",
                "--metrics",
                "angular-distance",
                "--out",
                str(f),
                "--batches",
                "1",
                "--batch-size",
                "1",
                "--seq-len",
                "8",
            ]
        )
        == 2
    )  # (any command: main names the path)
    err = capsys.readouterr().err
    assert "Errno" not in err and f"{str(f)!r} exists (a file) where a directory is to be created" in err


def test_info_refuses_zero_loops(capsys):
    assert main(["info", "tiny-llama", "--loops", "0", "--seq-len", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--loops must be an integer >= 1, got 0" in err and "--seq-len must be an integer >= 1, got -1" in err


def test_output_paths_through_a_file_are_named(tiny_run, tmp_path, capsys):
    """NotADirectoryError / IsADirectoryError were '[Errno 20] Not a directory: ...' (here from export hf)."""
    run, _ = tiny_run
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["export", "hf", str(run), str(f / "sub")]) == 2
    err = capsys.readouterr().err
    assert "Errno" not in err and f"{str(f)!r} is a file, not a directory" in err
    assert main(["task", "mano", "export", "--count", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Errno" not in err and f"{str(tmp_path)!r} is a directory where a file is to be written" in err
