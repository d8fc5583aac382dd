"""`looplm eval ppl` (token and word-level perplexity, checked by hand), `looplm plot`, `looplm demo`."""

import json
import math

import pytest
import torch

import looplm
from looplm.dataclass_util import to_dict
from looplm.eval.ppl import document_windows, evaluate_documents, ppl_from_nll, word_count
from looplm.train.checkpoint import save_checkpoint
from looplm.train.cli import main


class _Uniform(torch.nn.Module):
    """Zero logits: every next token has probability 1/V, so the NLL of each predicted token is ln V."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, **kw):
        return torch.zeros(*x.shape, self.vocab)


class _ByteTok:
    eos_id = 256
    vocab_size = 259

    def encode(self, text):
        return list(text.encode())


def test_formulas_by_hand():
    assert word_count("  the cat\tsat\n\non the mat ") == 6
    r = ppl_from_nll(nll=12.0, tokens=8, words=3, n_bytes=8)
    assert r.token_ppl == pytest.approx(math.exp(1.5))
    assert r.word_ppl == pytest.approx(math.exp(4.0))
    assert r.bits_per_byte == pytest.approx(12.0 / (8 * math.log(2)))


def test_windows_predict_every_token_once():
    ids = list(range(10))
    wins = document_windows(ids, seq_len=4, prefix_id=99)
    assert wins == [[99, 0, 1, 2], [2, 3, 4, 5], [5, 6, 7, 8], [8, 9]]
    predicted = [t for w in wins for t in w[1:]]
    assert predicted == ids


def test_uniform_model_word_ppl_is_hand_checkable():
    docs = ["ab cd", "efg"]  # 5 + 3 = 8 byte tokens, 2 + 1 = 3 words
    V = 260
    r = evaluate_documents(_Uniform(V), _ByteTok(), docs, seq_len=4, batch_size=2)
    assert (r.tokens, r.words, r.bytes, r.documents) == (8, 3, 8, 2)
    assert r.nll == pytest.approx(8 * math.log(V), rel=1e-6)
    assert r.token_ppl == pytest.approx(V, rel=1e-6)
    assert r.word_ppl == pytest.approx(V ** (8 / 3), rel=1e-6)  # exp(8 ln V / 3 words)


@pytest.fixture
def uniform_checkpoint(tmp_path):
    """A tiny-llama checkpoint whose LM head is zero: uniform predictions over its 260 ids."""
    model = looplm.build("tiny-llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", 1, model, None, {"step": 1}, {"model": to_dict(model.config), "tokenizer": "byte"})
    return run


def test_eval_ppl_cli_on_a_text_file(uniform_checkpoint, tmp_path, capsys):
    text = "hello world\nfoo bar baz\n"  # 24 bytes, 5 words
    (tmp_path / "test.txt").write_text(text)
    rc = main(
        ["eval", "ppl", str(uniform_checkpoint), "--data", str(tmp_path / "test.txt"), "--seq-len", "8", "--json"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tokens"], out["words"], out["documents"]) == (24, 5, 1)
    assert out["token_ppl"] == pytest.approx(260, rel=1e-5)
    assert out["word_ppl"] == pytest.approx(math.exp(24 * math.log(260) / 5), rel=1e-5)
    assert out["checkpoint"].endswith("step_000001")


def test_eval_ppl_cli_stdlib_and_batches(uniform_checkpoint, capsys):
    rc = main(
        [
            "eval",
            "ppl",
            str(uniform_checkpoint),
            "--data",
            "stdlib",
            "--batches",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "64",
        ]
    )
    assert rc == 0
    line = capsys.readouterr().out
    assert "token PPL 260.0" in line and "word PPL" in line


def test_eval_ppl_cli_errors(tmp_path, capsys):
    assert main(["eval", "ppl", str(tmp_path / "missing"), "--data", "stdlib"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_demo_and_plot_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(
        [
            "demo",
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--set",
            "data.seq_len=32",
            "--set",
            "train.global_batch_size=4",
            "--set",
            "train.micro_batch_size=4",
            "--set",
            "eval.batches=1",
            "--set",
            "eval.every=0",
            "--set",
            "logging.progress_bar=false",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "looplm demo summary" in text and "val loss" in text
    assert (out / "curves.png").stat().st_size > 1000
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= set(recs[0]) and "val_ppl" in recs[-1]
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["model"] == "tiny-llama" and run["packages"]["torch"]
    assert "git_sha" in run
    assert list((out / "tensorboard").iterdir())  # TensorBoard event file
    (out / "curves.png").unlink()
    assert main(["plot", str(out)]) == 0 and (out / "curves.png").exists()


def test_eval_ppl_with_exit_scores_each_window_at_adaptive_depth(tmp_path, capsys):
    """``evaluate_documents(exit=...)`` / ``looplm eval ppl --exit``: each window's tokens after its first take
    the exits in one forward (adaptive_forward, right padding masked); ε = 0 is the plain forward's NLL."""
    import torch.nn.functional as F

    from looplm.decode.exit_forward import adaptive_forward

    torch.manual_seed(0)
    model = looplm.build("tiny-llama", n_loops=5).eval()
    tok = _ByteTok()
    docs = ["hello world, a looped model", "foo bar baz qux", "one more document here"]
    plain = evaluate_documents(model, tok, docs, seq_len=12, batch_size=3)
    off = evaluate_documents(model, tok, docs, seq_len=12, batch_size=3, exit="kl:0")
    assert off.nll == pytest.approx(plain.nll, rel=1e-6) and off.depth["executed_ratio"] == 1
    got = evaluate_documents(model, tok, docs, seq_len=12, batch_size=100, exit="kl:0.003")
    wins = [w for d in docs for w in document_windows(tok.encode(d), 12, tok.eos_id)]
    L = max(len(w) for w in wins)
    x = torch.zeros(len(wins), L, dtype=torch.long)
    mask = torch.zeros(len(wins), L, dtype=torch.long)
    nll = 0.0
    for i, w in enumerate(wins):
        x[i, : len(w)], mask[i, : len(w)] = torch.tensor(w), 1
    out = adaptive_forward(model, x, "kl:0.003", attention_mask=mask, full_depth_prefix=1)
    for i, w in enumerate(wins):
        nll += float(F.cross_entropy(out.logits[i, : len(w) - 1], torch.tensor(w[1:]), reduction="sum"))
    assert got.nll == pytest.approx(nll, rel=1e-5) and got.nll != pytest.approx(plain.nll, rel=1e-4)
    assert got.depth["tokens"] == int(mask.sum()) and got.depth["executed_ratio"] < 1
    with pytest.raises(ValueError, match="no sliding-window band"):  # what one forward cannot run: before any document
        windowed = looplm.build(
            "tiny-llama", overrides={"attention.sliding_window": 4, "attention.sliding_layer_idx": [1]}
        )
        evaluate_documents(windowed.eval(), tok, docs, seq_len=12, exit="kl:0.1")
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", 1, model, None, {"step": 1}, {"model": to_dict(model.config), "tokenizer": "byte"})
    (tmp_path / "t.txt").write_text("\n\n".join(docs))
    assert (
        main(
            [
                "eval",
                "ppl",
                str(run),
                "--data",
                str(tmp_path / "t.txt"),
                "--seq-len",
                "12",
                "--exit",
                "kl:0.003",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert 1 < res["adaptive_depth"]["selected_depth"] < 5 and res["adaptive_depth"]["max_loops"] == 5
    assert (
        main(["eval", "ppl", str(run), "--data", str(tmp_path / "t.txt"), "--exit", "kl:0.01", "--loops", "1..3"]) == 2
    )  # a usage error
    assert "cannot be combined" in capsys.readouterr().err
