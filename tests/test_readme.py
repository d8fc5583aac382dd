"""The README stays true: its preset table is the generated one, and its commands exist."""

from pathlib import Path

import pytest

from looplm.cli import build_parser, presets_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_preset_table_is_current():
    text = README.read_text()
    assert presets_markdown() in text, "README preset table is stale: regenerate with `looplm presets --markdown`"


def test_quickstart_has_the_two_make_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (README.parent / ".ci" / "run").read_text()


@pytest.mark.parametrize(
    "cmd",
    ["presets", "info", "generate", "train", "eval", "plot", "demo", "data", "tokenizer", "analyze", "bench", "task", "grid",
     "export", "import"],
)
def test_every_cli_command_is_documented_and_exists(cmd):
    assert f"`looplm {cmd}" in README.read_text()
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert cmd in sub.choices
