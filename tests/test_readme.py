"""The README stays true and short: its links resolve, its commands exist and parse, its imports use the
current module paths; docs/presets.md is what `looplm presets --markdown` prints."""

import argparse
import re
import shlex
import warnings
from pathlib import Path

import pytest

from looplm._moved import MOVED
from looplm.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PRESETS_DOC = ROOT / "docs" / "presets.md"
REGENERATE = "looplm presets --markdown > docs/presets.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_presets_doc_is_current(capsys):
    assert main(["presets", "--markdown"]) == 0
    generated = capsys.readouterr().out
    assert PRESETS_DOC.exists(), f"docs/presets.md is missing: generate it with `{REGENERATE}`"
    assert PRESETS_DOC.read_text() == generated, (
        f"docs/presets.md is stale (a preset changed): regenerate it with `{REGENERATE}`"
    )
    assert REGENERATE in generated  # the page says how it is made


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n < 250, f"README.md has {n} lines (at most 249): move detail into docs/"


def test_readme_links_to_docs_exist():
    text = README.read_text()
    links = set(re.findall(r"(docs/[\w./-]+\.md)(#[\w-]+)?", text))
    assert links, "the README links no doc"
    for path, anchor in sorted(links):
        doc = ROOT / path
        assert doc.is_file(), f"README.md links {path}, which does not exist"
        if anchor:
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)}
            assert anchor[1:] in anchors, f"README.md links {path}{anchor}: no such heading in {path}"
    assert ("docs/presets.md", "") in links and ("docs/performance.md", "") in links


def test_readme_uses_no_moved_module_path():
    text = README.read_text()
    old = sorted(o for o in MOVED if re.search(rf"{re.escape(o)}(?![\w.])", text))
    assert not old, f"README.md names moved modules: {', '.join(f'{o} -> {MOVED[o]}' for o in old)}"
    assert "looplm.decode" in text


def test_readme_imports_run_without_deprecation():
    lines = [ln.strip() for b in _blocks("python") for ln in b.splitlines() if re.match(r"\s*(from|import) ", ln)]
    assert any("looplm.decode" in ln for ln in lines)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*moved to", category=DeprecationWarning)
        for ln in lines:
            exec(ln, {})


def test_readme_commands_parse():
    """Every `looplm ...` line of the README's bash blocks is accepted by the parser (nothing runs)."""
    cmds = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if "looplm.cli" in argv:  # torchrun ... -m looplm.cli train ...
                argv = ["looplm", *argv[argv.index("looplm.cli") + 1 :]]
            if argv[:1] == ["looplm"]:
                cmds.append(argv[1:])
    assert len(cmds) >= 10
    for argv in cmds:
        try:
            build_parser(argv[0]).parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: looplm {shlex.join(argv)}")


def test_quickstart_has_the_two_make_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (README.parent / ".ci" / "run").read_text()


@pytest.mark.parametrize(
    "cmd",
    [
        "presets",
        "info",
        "generate",
        "train",
        "eval",
        "plot",
        "demo",
        "data",
        "tokenizer",
        "analyze",
        "bench",
        "task",
        "grid",
        "export",
        "import",
    ],
)
def test_every_cli_command_is_documented_and_exists(cmd):
    assert f"`looplm {cmd}" in README.read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert cmd in sub.choices
