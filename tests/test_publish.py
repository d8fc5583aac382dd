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
