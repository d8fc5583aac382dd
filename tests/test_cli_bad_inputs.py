"""Every ``looplm`` sub-command refuses bad values with a clean error: a non-zero exit and no traceback.

The sub-commands are enumerated from the argparse parser itself (:func:`looplm.cli.build_parser`), so a new
one fails :func:`test_every_subcommand_has_bad_values` until it gets rows in :data:`BAD` below. Each row is
one command line with one bad value (everything else valid), run in this process through
:func:`looplm.cli.main` (argparse's exits caught), its stderr captured.

Nothing here listens on a port or reaches the network: ``serve`` / ``chat`` rows are values refused before
the server starts (starting it, or a client connecting, fails the row), and every model is a random tiny
preset or a checkpoint of one written once per module into ``tmp_path``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys

import pytest
import torch

import looplm
from looplm.cli import build_parser, main
from looplm.data.tokenizers import ByteTokenizer
from looplm.dataclass_util import to_dict
from looplm.train.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

G = ["generate", "--model", "tiny-llama", "--max-new-tokens", "4"]
PPL = ["eval", "ppl", "{ckpt}", "--data", "{text}", "--batches", "1"]
THR = ["eval", "threshold", "{ckpt}", "--data", "{text}", "--batches", "1", "--decode-batches", "0"]
HARN = ["eval", "harness", "{ckpt}", "--tasks", "no-such-task"]
BA = ["bench", "adaptive", "--runs-dir", "{tmp}/bench-runs", "--data", "{text}", "--same-process"]
BS = ["bench", "serve", "--model", "tiny-llama"]
SRV = ["serve", "tiny-llama"]
CHAT = ["chat", "tiny-llama"]

# sub-command -> rows (argv after the sub-command's words are already in it; optional regex the error must match).
# Placeholders: {ckpt} a tiny-llama checkpoint run (max_seq_len 64), {k1} one with K = 1, {text} a small text
# file, {file} an existing file, {tmp} an empty directory of this module, {missing} a path that does not exist.
BAD: dict[str, list[tuple[list[str], str | None]]] = {
    "presets": [(["presets", "--jsn"], "unrecognized arguments")],
    "info": [
        (["info", "no-such-preset"], None),
        (["info", "tiny-llama", "--loops", "0"], None),
        (["info", "tiny-llama", "--seq-len", "-1"], None),
        (["info", "tiny-llama", "--set", "n_loops=x"], None),
    ],
    "generate": [
        ([*G, "--max-new-tokens", "-1"], "max_new_tokens"),
        ([*G, "--top-p", "2"], "top_p"),
        ([*G, "--temperature", "nan"], "temperature"),
        ([*G, "--top-k", "-1"], "top_k"),
        ([*G, "--loops", "0"], "num_loops"),
        ([*G, "--loops", "100000"], "--allow-deep"),
        ([*G, "--exit", "kl:0", "--max-loops", "100000000"], "--allow-deep"),
        ([*G, "--exit", "replay:99"], "replay depth 99"),
        ([*G, "--speculative", "1", "--draft-k", "600"], "600"),
        ([*G, "--speculative", "1", "--draft-k", "1000000"], "1000000"),
        ([*G, "--speculative", "1", "--draft-k", "0"], "k"),
        ([*G, "--exit", "kl:abc"], "not a number"),
        ([*G, "--exit", "kl:0.1", "--min-loops", "0"], "min_loops"),
        ([*G, "--prompt", ""], None),
        ([*G, "--max-new-tokens", "100000"], "max_seq_len"),
        ([*G, "--set", "n_loops=0"], "n_loops"),
        (["generate", "--checkpoint", "{k1}", "--speculative", "1"], "K >= 2"),
        (["generate", "--checkpoint", "{missing}"], None),
        (["generate", "--checkpoint", "{ckpt}", "--max-new-tokens", "100"], "max_seq_len"),
    ],
    "data prepare": [
        (["data", "prepare", "{text}", "--out", "{tmp}/prep1", "--seq-len", "0"], None),
        (["data", "prepare", "{text}", "--out", "{tmp}/prep2", "--max-docs", "-1"], None),
        (["data", "prepare", "{text}", "--out", "{tmp}/prep3", "--shard-tokens", "0"], None),
        (["data", "prepare", "{missing}", "--out", "{tmp}/prep4"], None),
        (["data", "prepare", "{text}", "--out", "{file}"], None),
    ],
    "tokenizer train": [
        (["tokenizer", "train", "{text}", "--vocab-size", "0", "--out", "{tmp}/tok1"], None),
        (["tokenizer", "train", "{text}", "--vocab-size", "300", "--min-frequency", "-1", "--out", "{tmp}/tok2"], None),
        (["tokenizer", "train", "{missing}", "--vocab-size", "300", "--out", "{tmp}/tok3"], None),
    ],
    "eval ppl": [
        ([*PPL, "--batch-size", "0"], "--batch-size"),
        ([*PPL, "--seq-len", "0"], "--seq-len"),
        ([*PPL, "--seq-len", "100000"], "max_seq_len"),
        ([*PPL, "--batches", "0"], "--batches"),
        ([*PPL, "--max-docs", "0"], "--max-docs"),
        ([*PPL, "--loops", "abc"], "--loops"),
        ([*PPL, "--loops", "0"], "--loops"),
        ([*PPL, "--loops", "1000000"], "--allow-deep"),
        ([*PPL, "--loops", "1..3", "--out", "{file}"], "{file}"),
        ([*PPL, "--exit", "replay:99"], "replay depth 99"),
        ([*PPL, "--device", "tpu"], "--device"),
        ([*PPL, "--kv-policy", "copy"], "an option of --exit"),
        (["eval", "ppl", "{missing}", "--data", "{text}"], None),
        (["eval", "ppl", "{ckpt}", "--data", "{missing}"], None),
    ],
    "eval threshold": [
        ([*THR, "--batches", "0"], "--batches"),
        ([*THR, "--batch-size", "0"], "--batch-size"),
        ([*THR, "--seq-len", "0"], "--seq-len"),
        ([*THR, "--seq-len", "100000"], "max_seq_len"),
        ([*THR, "--thresholds", "0.5"], "exit gate"),
        ([*THR, "--loops", "0"], "--loops"),
        ([*THR, "--loops", "1000000"], "--allow-deep"),
        ([*THR, "--decode-batches", "-1"], "--decode-batches"),
        ([*THR, "--limit", "0"], "--limit"),
        ([*THR, "--png", "{file}/x.png"], "--png"),
        ([*THR, "--png", "{tmp}"], "is a directory"),
        ([*THR, "--device", "tpu"], "--device"),
        ([*THR, "--loops"], "nothing to evaluate"),
        ([*THR, "--thresholds", "0"], r"\(0, 1\]"),
    ],
    "eval harness": [
        ([*HARN, "--batch-size", "0"], None),
        ([*HARN, "--loops", "0"], None),
        ([*HARN, "--max-length", "0"], None),
        ([*HARN, "--exit-threshold", "2"], None),
        ([*HARN, "--limit", "-1"], None),
        ([*HARN, "--loops", "1000000"], None),
        ([*HARN, "--output-json", "{file}/out.json"], "--output-json"),
        ([*HARN, "--device", "tpu"], "--device"),
        ([*HARN, "--threads", "0"], "--threads"),
        (["eval", "harness", "--write-tasks", "{file}"], "{file}"),
        (["eval", "harness", "{missing}", "--tasks", "x"], None),
    ],
    "train": [
        (["train", "{missing}", "--out", "{tmp}/train1"], None),
        (["train", "tiny-llama", "--out", "{tmp}/train2", "--max-steps", "-1"], None),
        (["train", "tiny-llama", "--out", "{file}"], None),
        (["train", "tiny-llama", "--out", "{tmp}/train3", "--checkpoint-every", "0"], None),
    ],
    "plot": [(["plot", "{missing}"], None), (["plot", "{tmp}"], None)],
    "demo": [
        (["demo", "--max-steps", "-1", "--out", "{tmp}/demo1"], None),
        (["demo", "--out", "{file}"], None),
        (["demo", "--config", "{missing}", "--out", "{tmp}/demo2"], None),
    ],
    "task mano export": [
        (["task", "mano", "export", "--count", "-1", "--out", "{tmp}/m.jsonl"], None),
        (["task", "mano", "export", "--count", "0", "--out", "{tmp}/m0.jsonl"], None),
        (["task", "mano", "export", "--max-length", "0", "--out", "{tmp}/m2.jsonl"], None),
        (["task", "mano", "export", "--out", "{tmp}"], None),
    ],
    "task mano train": [(["task", "mano", "train", "{missing}", "--out", "{tmp}/mt"], None)],
    "task mano eval": [
        (["task", "mano", "eval", "{missing}", "--count", "-1"], None),
        (["task", "mano", "eval", "{missing}"], None),
    ],
    "task phop export": [
        (["task", "phop", "export", "--count", "-1", "--out", "{tmp}/p.jsonl"], None),
        (["task", "phop", "export", "--p", "0", "--out", "{tmp}/p2.jsonl"], None),
        (["task", "phop", "export", "--n", "0", "--out", "{tmp}/p3.jsonl"], None),
        (["task", "phop", "export", "--alphabet", "0", "--out", "{tmp}/p4.jsonl"], None),
    ],
    "task phop train": [(["task", "phop", "train", "{missing}", "--out", "{tmp}/pt"], None)],
    "task phop eval": [
        (["task", "phop", "eval", "{missing}", "--loops", "0"], None),
        (["task", "phop", "eval", "{missing}"], None),
    ],
    "grid": [(["grid", "{missing}"], None), (["grid", "{file}"], None)],
    "analyze": [
        (
            [
                "analyze",
                "--model",
                "tiny-llama",
                "--metrics",
                "angular-distance",
                "--out",
                "{tmp}/an1",
                "--batches",
                "0",
            ],
            None,
        ),
        (["analyze", "--model", "tiny-llama", "--metrics", "no-such-metric", "--out", "{tmp}/an2"], None),
        (["analyze", "--model", "tiny-llama", "--metrics", "angular-distance", "--out", "{file}"], None),
        (
            [
                "analyze",
                "--model",
                "tiny-llama",
                "--metrics",
                "angular-distance",
                "--out",
                "{tmp}/an3",
                "--seq-len",
                "0",
            ],
            None,
        ),
        (
            [
                "analyze",
                "--model",
                "tiny-llama",
                "--metrics",
                "angular-distance",
                "--out",
                "{tmp}/an4",
                "--device",
                "tpu",
            ],
            None,
        ),
    ],
    "bench decode": [
        (["bench", "decode", "--threads", "-4"], None),
        (["bench", "decode", "--new", "0"], None),
        (["bench", "decode", "--models", "nope"], None),
    ],
    "bench adaptive": [
        ([*BA, "--dtypes", "fp8"], "--dtypes"),
        ([*BA, "--new", "-1"], "--new"),
        ([*BA, "--kl", "abc"], "--kl"),
        ([*BA, "--k", "0"], "--k"),
        ([*BA, "--drafts", "99"], "--drafts"),
        ([*BA, "--timing-runs", "0"], "--timing-runs"),
        ([*BA, "--convergence", "-1"], "--convergence"),
        ([*BA, "--qs", "2"], "--qs"),
        ([*BA, "--widths", "abc"], "--widths"),
        ([*BA, "--policies", "nope"], "--policies"),
        ([*BA, "--threads", "-1"], "--threads"),
        ([*BA, "--lm-steps", "0"], "--lm-steps"),
        ([*BA, "--draft-exits", "nope:1"], "--draft-exits"),
        ([*BA, "--data", "{missing}"], "--data"),
        ([*BA, "--out", "{tmp}"], "--out"),
        ([*BA, "--png-dir", "{file}"], "--png-dir"),
    ],
    "bench serve": [
        ([*BS, "--requests", "0"], None),
        ([*BS, "--concurrency", "abc"], None),
        ([*BS, "--prompt-len", "0"], None),
        ([*BS, "--max-tokens", "0"], None),
        ([*BS, "--rates", "-1"], None),
        (["bench", "serve", "--model", "{missing}"], None),
        ([*BS, "--exit", "kl:abc"], "--exit 'kl:abc'"),
        ([*BS, "--exit", "replay:2"], "cannot be served"),
    ],
    "export hf": [
        (["export", "hf", "{missing}", "{tmp}/ex1"], None),
        (["export", "hf", "{ckpt}", "{tmp}/ex2", "--loops", "0"], None),
        (["export", "hf", "{ckpt}", "{tmp}/ex3", "--exit-threshold", "2"], None),
        (["export", "hf", "{ckpt}", "{file}"], None),
    ],
    "import hf": [(["import", "hf", "{missing}", "{tmp}/im1"], None), (["import", "hf", "{ckpt}", "{file}"], None)],
    "kernels build": [(["kernels", "build", "--jobs"], "unrecognized arguments")],
    "kernels status": [(["kernels", "status", "--lod"], "unrecognized arguments")],
    "serve": [
        ([*SRV, "--max-batch", "0"], None),
        ([*SRV, "--port", "-1"], None),
        ([*SRV, "--kv-budget", "abc"], None),
        ([*SRV, "--max-model-len", "0"], None),
        ([*SRV, "--exit", "kl:abc"], None),
        ([*SRV, "--threads", "0"], None),
        ([*SRV, "--grace-s", "-1"], None),
        ([*SRV, "--max-waiting", "-1"], None),
        (["serve", "{missing}"], None),
        ([*SRV, "--exit-prefill", "exit"], "needs --exit"),
        ([*SRV, "--exit", "kl:0.01", "--exit-prefill", "exit", "--prefill-chunk", "8"], "leave --prefill-chunk out"),
        ([*SRV, "--exit", "kl:0.01", "--exit-prefill", "exit", "--kv-policy", "shared"], "kv policy 'shared'"),
    ],
    "chat": [
        ([*CHAT, "--max-batch", "0"], None),
        ([*CHAT, "--max-tokens", "0"], None),
        ([*CHAT, "--temperature", "-1"], None),
        ([*CHAT, "--exit", "kl:abc"], None),
        ([*CHAT, "--threads", "0"], None),
    ],
}


def _leaves(parser: argparse.ArgumentParser, path=()):
    """``[(words, parser)]`` of every runnable sub-command (``("eval", "ppl")``, ...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [leaf for name, p in subs[0].choices.items() for leaf in _leaves(p, (*path, name))]


LEAVES = [" ".join(words) for words, _ in _leaves(build_parser(None))]


def test_every_subcommand_has_bad_values():
    missing = [c for c in LEAVES if c not in BAD]
    assert not missing, f"add rows of bad values for the new sub-command(s) {missing} to BAD in {__file__}"
    assert not [c for c in BAD if c not in LEAVES], "BAD names a sub-command the parser no longer has"


class _Refused(Exception):
    """A row went past where its bad value should have been refused (a server started, a client connected,
    a benchmark began training its models)."""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The placeholders' values: tiny checkpoints (K = 3, and K = 1), a text file, an existing file, a scratch dir."""
    root = tmp_path_factory.mktemp("bad-inputs")
    tok = ByteTokenizer()
    record = lambda m: {"model": to_dict(m.config), "tokenizer": "byte", "tokenizer_fingerprint": tok.fingerprint()}  # noqa: E731
    out = {}
    for key, kw in (("ckpt", {}), ("k1", {"n_loops": 1})):
        torch.manual_seed(0)
        m = looplm.build("tiny-llama", max_seq_len=64, **kw)
        save_checkpoint(root / key / "ckpt", 1, m, None, {"step": 1}, record(m))
        out[key] = str(root / key)
    text = root / "text.txt"
    text.write_text("The loop runs again and again, over and over.\n" * 5)  # one document: 5 windows of 64 bytes
    (root / "file").write_text("an existing file\n")
    (root / "scratch").mkdir()
    out.update(text=str(text), file=str(root / "file"), tmp=str(root / "scratch"), missing=str(root / "no-such-path"))
    return out


@pytest.fixture
def no_servers(monkeypatch):
    """Starting a server or connecting a client fails the row: its bad value should have been refused first."""

    def refuse(*a, **k):
        raise _Refused("the command went on to start a server / connect (its bad value was not refused first)")

    from looplm.serve import server

    monkeypatch.setattr(server, "run_server", refuse)
    monkeypatch.setattr(server.Server, "start", refuse)
    monkeypatch.setattr("socket.socket.connect", refuse)
    monkeypatch.setattr("socket.socket.bind", refuse)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # bench adaptive / decode: no re-run of themselves in a child
    from looplm.bench import adaptive

    for name in ("train_lm", "train_phop", "load_lm"):  # minutes of training: every flag is checked before
        monkeypatch.setattr(adaptive, name, refuse)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``looplm argv`` in this process: (exit status, stderr). An exception escaping ``main`` is a traceback."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse, or SystemExit("error: ..."), which Python prints to stderr
            rc = e.code if isinstance(e.code, int) or e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except _Refused:
            raise
        except BaseException:  # what a user would see as a traceback
            import traceback

            traceback.print_exc()
            rc = 1
    return rc, err.getvalue()


# rows that still fail in modules outside this change, (sub-command, flag, value) -> where and why (xfail, not
# strict: they pass once fixed)
KNOWN: dict[tuple[str, str, str], str] = {}


def _marks(cmd, argv):
    pairs = set(zip(argv, argv[1:]))
    why = [r for (c, flag, value), r in KNOWN.items() if c == cmd and (flag, value) in pairs]
    return [pytest.mark.xfail(reason=why[0], strict=False)] if why else []


ROWS = [
    pytest.param(cmd, argv, match, id=f"{cmd}: {' '.join(argv[len(cmd.split()) :])}", marks=_marks(cmd, argv))
    for cmd, rows in BAD.items()
    for argv, match in rows
]


@pytest.mark.parametrize("cmd,argv,match", ROWS)
def test_bad_value_is_a_clean_error(cmd, argv, match, paths, no_servers, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # (chat reads its prompts from stdin)
    argv = [a.format(**paths) for a in argv]
    rc, err = run_cli(argv)
    assert "Traceback (most recent call last)" not in err, err
    assert rc != 0, f"`looplm {' '.join(argv)}` exited 0:\n{err}"
    assert err.strip(), "refused without saying why"
    if match is not None:
        assert re.search(match.format(**paths), err), err


def test_bench_adaptive_valid_flags_get_to_training(paths, no_servers):
    """The checks refuse bad flags only: the defaults (and a speculative grid within the LM's K) go on to train."""
    argv = [a.format(**paths) for a in BA] + ["--drafts", "1,3", "--k", "2,4", "--draft-exits", "kl:0.01"]
    with pytest.raises(_Refused):
        run_cli(argv)
