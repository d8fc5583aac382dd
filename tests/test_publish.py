"""benchmarks/publish.py: a benchmark's output becomes its own section of docs/performance.md, with the
command, the machine and the date; a rerun replaces the section, a failed run leaves the document."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PUBLISH = Path(__file__).resolve().parents[1] / "benchmarks" / "publish.py"


def _run(doc: Path, name: str, body: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(PUBLISH), name, "A table", "--doc", str(doc), "--", "python", "-c", body]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_sections_are_written_replaced_and_kept_on_failure(tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n\nintro\n")
    table = "print('# CPU: test'); print('## sub'); print('| a | b |'); print('| --- | --- |'); print('| 1 | {} |')"
    assert _run(doc, "demo", table.format(2)).returncode == 0
    text = doc.read_text()
    assert text.startswith("# Performance\n\nintro\n") and "## A table" in text and "- CPU: test" in text
    assert "\n**sub**\n" in text  # a table's own heading: bold, not a section heading of the document
    assert "| 1 | 2 |" in text and "cores, torch " in text and "`python -c " in text
    assert _run(doc, "demo", table.format(3)).returncode == 0
    text = doc.read_text()
    assert text.count("<!-- bench:demo -->") == 1 and "| 1 | 3 |" in text and "| 1 | 2 |" not in text
    assert _run(doc, "other", table.format(4)).returncode == 0
    assert "| 1 | 3 |" in doc.read_text() and "| 1 | 4 |" in doc.read_text()
    before = doc.read_text()
    r = _run(doc, "demo", "import sys; print('| partial |'); sys.exit(3)")
    assert r.returncode == 3 and "left as it was" in r.stderr and doc.read_text() == before


def _publish_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("publish", PUBLISH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paths_are_written_without_the_machine_folders():
    portable = _publish_module().portable
    root, home = "/srv/u/looplm", "/home/u"

    def p(text):
        return portable(text, root=root, home=home)

    assert (
        p("--lm-config /srv/u/looplm/configs/a.yaml --out=/srv/u/looplm/runs/x/")
        == "--lm-config configs/a.yaml --out=runs/x/"
    )
    assert p("cd /srv/u/looplm && ls") == "cd . && ls"
    assert p("--data '/srv/u/shared/data/tiny.txt'") == "--data '../shared/data/tiny.txt'"
    assert (
        p("--runs-dir /work/runs/lm1024 --out /work/wt/a/runs/lm1024/t.json")
        == "--runs-dir RUNS/lm1024 --out RUNS/lm1024/t.json"
    )
    assert p("wrote /home/u/.cache/looplm/plans.json.") == "wrote ~/.cache/looplm/plans.json."
    assert p("--ckpt /tmp/pytest-1/ckpt.pt") == "--ckpt DIR/ckpt.pt"
    # what is the same on every machine, relative paths, URLs and the slashes of a table stay
    same = "/proc/cpuinfo /dev/shm/x ../shared/data ~/x runs/lm https://huggingface.co/a/b ms/tok | ε / q | 1/2"
    assert p(same) == same


def test_a_published_section_names_no_absolute_path(tmp_path):
    root = PUBLISH.parents[1]
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n")
    inside, shared, runs = f"{root}/runs/demo", f"{root.parent}/shared/data/x.txt", "/nowhere/runs/lm1024/r.json"
    body = f"print('# data: {shared}'); print('| {runs} |'); print('wrote {inside}/report.json')"
    cmd = [
        sys.executable,
        str(PUBLISH),
        "paths",
        "A table",
        "--doc",
        str(doc),
        "--",
        "python",
        "-c",
        body,
        inside,
        shared,
    ]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    text = doc.read_text()
    assert str(root) not in text and "/nowhere" not in text, text
    assert (
        "- data: ../shared/data/x.txt" in text
        and "| RUNS/lm1024/r.json |" in text
        and "wrote runs/demo/report.json" in text
    )
    assert "runs/demo ../shared/data/x.txt`" in text  # the command's own arguments
