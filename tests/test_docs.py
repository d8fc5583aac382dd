"""The docs name no folder of a machine: no absolute home, work or temporary path in docs/ or README.md.

Paths in commands are relative to the checkout, ``../shared/`` for the shared folder beside it, ``RUNS/`` for a
run directory outside it (see the top of docs/performance.md). Only the files of this repository are read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix in (".md", ".txt", ".rst")) + [
    ROOT / "README.md"
]

# an absolute path of two or more parts, not inside a word, a relative path (../shared/x), a URL or ~/x
ABSOLUTE = re.compile(
    r"(?<![\w.~/:-])/(?:[\w.+@%=$-]+/)+[\w.+@%=$-]*|\b[A-Za-z]:\\(?:Users|Documents and Settings)\\\S*"
)
# what is the same on every machine, each allowed on its own
ALLOWED_PREFIXES = (
    "/proc/",
    "/dev/",
    "/sys/",  # Linux's own: /proc/cpuinfo, /dev/shm
    "/v1/",
)  # the OpenAI routes of looplm serve (docs/serving.md), not files
ALLOWED = {
    "/tmp/torchinductor_$USER",  # torch inductor's default cache folder, named as torch names it (docs/training.md)
    "/shared/runs/x",  # the two-node example's output on a file system both nodes mount (docs/training.md)
}


def offending(text: str) -> list[str]:
    found = (m.group(0) for m in ABSOLUTE.finditer(text))
    return [p for p in found if p not in ALLOWED and not p.startswith(ALLOWED_PREFIXES)]


def test_the_matcher_finds_machine_paths_and_only_those():
    bad = "--runs-dir /work/runs/lm1024 `/root/.cache/x` /home/alice/data.txt /Users/bob/x /tmp/a/b --out=/mnt/d/e C:\\Users\\bob\\x"
    assert offending(bad) == [
        "/work/runs/lm1024",
        "/root/.cache/x",
        "/home/alice/data.txt",
        "/Users/bob/x",
        "/tmp/a/b",
        "/mnt/d/e",
        "C:\\Users\\bob\\x",
    ]
    fine = (
        "../shared/data/x.txt RUNS/lm1024 runs/lm ~/.cache/looplm/plans.json https://huggingface.co/a/b "
        "file:///x/y /proc/cpuinfo /dev/shm/x /v1/chat/completions ms/tok | ε / q | 1/2 <!-- /bench:name --> /tmp/torchinductor_$USER"
    )
    assert offending(fine) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_absolute_machine_path(path):
    bad = [
        f"{path.relative_to(ROOT)}:{n}: {p}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for p in offending(line)
    ]
    assert not bad, (
        "absolute paths of a machine (write them relative to the checkout, ../shared/ or RUNS/):\n" + "\n".join(bad)
    )
