"""Run a benchmark and write what it printed into its own section of ``docs/performance.md``.

Every table in ``docs/performance.md`` is a benchmark's own output, never typed by hand: this runs the
command, echoes its output, and replaces the section named ``NAME`` (between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``, appended at the end the first time) with a heading, the command, the machine
(CPU model, cores, bf16 support, torch) and the date, then the output — its ``#`` comment lines as a
list, its markdown tables as they are::

    python benchmarks/publish.py decode "Decoding vs transformers" -- python benchmarks/bench_decode.py --rounds 3
    python benchmarks/publish.py tab3 "StateLoop Tab. 3 on the lean path" -- looplm bench decode --lean --dtype bf16

A command that fails leaves the document as it was. No absolute path of this machine reaches the document:
the command and the output are written with ``portable`` (paths relative to the checkout, ``../shared/`` for
the shared folder beside it, ``RUNS/`` for a ``runs`` folder outside it, ``~/`` for the home folder, ``DIR/``
for any other folder).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"

# an absolute path of two or more parts, not inside a word, a relative path, a URL (``x://``) or ``~/``
_ABSOLUTE = re.compile(r"(?<![\w.~/:-])/(?:[\w.+@%=-]+/)+[\w.+@%=-]*")
_SYSTEM = ("/dev/", "/proc/", "/sys/")  # the same on every Linux machine: kept as they are


def portable(text: str, root: Path | str = ROOT, home: Path | str | None = None) -> str:
    """``text`` with each absolute path written without this machine's folders: inside the checkout ``root``
    relative to it (``runs/lm``); inside the ``shared`` folder beside the checkout as ``../shared/...``; below a
    folder named ``runs`` elsewhere as ``RUNS/...`` (what follows the last ``runs``); inside ``home`` (by
    default this user's) as ``~/...``; anything else as ``DIR/`` and its last part. ``/dev/``, ``/proc/`` and
    ``/sys/`` stay. Pure string work: nothing on disk is read."""
    root = PurePosixPath(os.path.normpath(str(root)))
    home = PurePosixPath(os.path.normpath(str(Path.home() if home is None else home)))

    def under(path: PurePosixPath, base: PurePosixPath, name: str) -> str | None:
        if path == base:
            return name
        return f"{name}/{path.relative_to(base).as_posix()}" if base in path.parents else None

    def one(m: re.Match) -> str:
        raw = m.group(0)
        stop = raw[len(raw.rstrip(".")) :] if not raw.endswith("/.") else ""  # a sentence's full stop
        raw = raw[: len(raw) - len(stop)]
        if raw.startswith(_SYSTEM):
            return raw + stop
        path = PurePosixPath(os.path.normpath(raw))
        parts = path.parts
        runs = len(parts) - parts[::-1].index("runs") if "runs" in parts else 0
        out = (
            under(path, root, ".")
            or under(path, root.parent / "shared", "../shared")
            or (under(path, PurePosixPath(*parts[:runs]), "RUNS") if runs else None)
            or under(path, home, "~")
            or f"DIR/{path.name}"
        )
        out = out[2:] if out.startswith("./") else out
        return (out + "/" if raw.endswith("/") and not out.endswith("/") else out) + stop

    return _ABSOLUTE.sub(one, text)


def machine() -> str:
    """One line naming the machine: CPU model and cores, its bf16 support, torch, the GPU if any."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from _machine import cpu_info

    line = f"{cpu_info()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        line += f", GPU {torch.cuda.get_device_name()}"
    return line


def render(name: str, title: str, command: list[str], output: str, when: str, where: str) -> str:
    """The section: heading, provenance, then the output (comment lines as a list, ``## `` headings bold,
    tables verbatim), the command and the output with ``portable`` paths."""
    lines = [f"<!-- bench:{name} -->", f"## {title}", "", f"`{portable(shlex.join(command))}` — {where} — {when}", ""]
    for raw in portable(output).rstrip().splitlines():
        if raw.startswith("# "):
            lines.append(f"- {raw[2:]}")
        elif raw.startswith("## "):  # a table's own heading (looplm bench adaptive): bold, under the section's
            lines.append(f"**{raw[3:].strip()}**")
        elif raw.startswith("|") or not raw.strip():
            lines.append(raw)
        else:
            lines.append(f"    {raw}")  # anything else as preformatted text
    lines += ["", f"<!-- /bench:{name} -->"]
    return "\n".join(_blank_line_around_tables(lines))


def _blank_line_around_tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    for i, line in enumerate(lines):
        is_row = line.startswith("|")
        if is_row and out and out[-1].strip() and not out[-1].startswith("|"):
            out.append("")
        if not is_row and line.strip() and out and out[-1].startswith("|"):
            out.append("")
        out.append(line)
    return out


def replace_section(doc: str, name: str, section: str) -> str:
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    if pattern.search(doc):
        return pattern.sub(lambda _: section, doc, count=1)
    return doc.rstrip() + "\n\n" + section + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: publish.py NAME TITLE [--doc PATH] -- COMMAND ...")
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="section name (letters, digits, -)")
    ap.add_argument("title")
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args(argv[:i])
    command = argv[i + 1 :]
    if not re.fullmatch(r"[A-Za-z0-9-]+", args.name) or not command:
        raise SystemExit(
            f"publish.py: a section name of letters, digits and '-' and a command are needed, got {args.name!r} {command}"
        )
    shown = command
    if command[0] == "looplm":  # the installed entry point, run as this interpreter's module
        command = [sys.executable, "-m", "looplm.cli", *command[1:]]
    elif command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    if proc.wait() != 0:
        print(f"publish.py: {shlex.join(shown)} exited {proc.returncode}; {args.doc} left as it was", file=sys.stderr)
        return proc.returncode
    when = datetime.date.today().isoformat()
    section = render(args.name, args.title, shown, "".join(out), when, machine())
    doc = args.doc.read_text() if args.doc.exists() else "# Performance\n"
    args.doc.write_text(replace_section(doc, args.name, section))
    print(f"publish.py: wrote section {args.name!r} of {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
