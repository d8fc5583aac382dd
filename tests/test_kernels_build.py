"""The explicit build of looplm's CPU extension (looplm/kernels/loader.py): one directory per source version,
a lock whose dead holder never hangs the next run, torch's stale lock removed, status and its reasons."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from looplm.kernels import loader

pytestmark = pytest.mark.kernels


def test_the_build_directory_is_named_by_its_sources(tmp_path, monkeypatch):
    """A checkout with other sources builds into another directory instead of rebuilding a shared one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    var, _, name, build_dir = loader._name_and_dir()
    assert name.startswith(f"looplm_cpu_{var}_") and build_dir == tmp_path / "ext" / name
    assert loader._name_and_dir()[2] == name  # stable
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in (*loader.SOURCES, *loader.HEADERS):
        (copy / f).write_bytes((loader.CSRC / f).read_bytes())
    (copy / "gemv.cpp").write_bytes((copy / "gemv.cpp").read_bytes() + b"\n// another checkout\n")
    monkeypatch.setattr(loader, "CSRC", copy)
    assert loader._name_and_dir()[2] != name


def _hold_lock(build_dir: Path) -> subprocess.Popen:
    """A process that takes the build lock of ``build_dir`` and sleeps (a build in progress)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from looplm.kernels import loader
        with loader._build_lock(Path({str(build_dir)!r})):
            print("held", flush=True)
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_killed_holder_never_hangs_the_next_build(tmp_path):
    p = _hold_lock(tmp_path)
    os.killpg(p.pid, signal.SIGKILL)  # kill -9 in the middle of a "build"
    p.wait()
    t0 = time.monotonic()
    with loader._build_lock(tmp_path):
        assert (tmp_path / "looplm_build.lock").read_text() == str(os.getpid())
    assert time.monotonic() - t0 < 5


def test_a_live_holder_is_waited_for_and_named(tmp_path, monkeypatch, capfd):
    p = _hold_lock(tmp_path)
    try:
        monkeypatch.setenv("LOOPLM_KERNELS_BUILD_TIMEOUT", "3")
        with pytest.raises(TimeoutError, match=rf"lock {tmp_path}/looplm_build.lock, held by pid {p.pid}"):
            with loader._build_lock(tmp_path):
                pass
        assert f"waiting for pid {p.pid}, which is building the CPU kernels" in capfd.readouterr().err
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_torchs_stale_lock_is_removed_under_ours(tmp_path, monkeypatch, capfd):
    """A kill -9 during torch's build leaves ``lock`` behind, on which every later torch load() waits forever;
    under looplm's lock no build of the directory can be running, so it is stale: removed, with a line."""
    (tmp_path / "lock").touch()
    seen = []

    def fake_load(**kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").write_bytes(b"\x7fELF")

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", fake_load)
    with loader._build_lock(tmp_path):
        loader._compile("looplm_cpu_test", tmp_path, [], "portable")
    assert seen == [False]
    err = capfd.readouterr().err
    assert f"removed a stale build lock left by a killed build ({tmp_path}/lock)" in err
    assert "building the CPU kernels for this CPU (portable) once" in err and "built the CPU kernels in" in err


def test_status_says_why_not(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOPLM_CPU_KERNELS", "0")
    st = loader.status()
    assert (st.variant, st.built, st.reason) == ("off", False, "switched off by LOOPLM_CPU_KERNELS=0")
    assert not loader.load_extension()
    monkeypatch.delenv("LOOPLM_CPU_KERNELS")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_state", {})
    st = loader.status()
    assert not st.built and not st.loaded and "not built yet: run `looplm kernels build`" in st.reason
    monkeypatch.setattr(
        loader, "_state", {"ok": False, "reason": "could not build looplm's CPU extension (OSError: no compiler)"}
    )
    assert loader.status().reason == "could not build looplm's CPU extension (OSError: no compiler)"


def test_kernels_status_cli(tmp_path):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("LOOPLM_CPU_KERNELS", None)
    out = subprocess.run(
        [sys.executable, "-m", "looplm.cli", "kernels", "status"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "not built yet: run `looplm kernels build`" in out and str(tmp_path) in out
    env["LOOPLM_CPU_KERNELS"] = "0"
    out = subprocess.run(
        [sys.executable, "-m", "looplm.cli", "info", "tiny-llama"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "CPU kernels         off (switched off by LOOPLM_CPU_KERNELS=0)" in out


def _start_build(tmp_path: Path, log: str) -> subprocess.Popen:
    """A real `looplm kernels build` into ``tmp_path`` (its own process group), stderr to ``tmp_path/log``."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("LOOPLM_CPU_KERNELS", None)
    with open(tmp_path / log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "looplm.cli", "kernels", "build"],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _wait_for(p: subprocess.Popen, done, what: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while not done():
        if p.poll() is not None or time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"{what}: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """kill -9 of a real `looplm kernels build` while torch holds its lock: the next build says it removed the
    stale lock and compiles (torch's lock is its own again), instead of waiting forever with no output (the
    bug). It is stopped there: compiling to the end takes a minute on 2 cores, and `make install` builds for real."""
    first = _start_build(tmp_path, "first.err")
    try:
        _wait_for(
            first,
            lambda: list(tmp_path.glob("looplm_cpu_*/lock")),
            "the build never took torch's lock",
            tmp_path / "first.err",
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    (stale,) = tmp_path.glob("looplm_cpu_*/lock")
    second, log = _start_build(tmp_path, "second.err"), tmp_path / "second.err"
    try:
        _wait_for(second, lambda: "building the CPU kernels" in log.read_text(), "the second build waited", log)
        assert f"removed a stale build lock left by a killed build ({stale})" in log.read_text()
        # the line above is said once the stale lock is gone: a lock now is the one torch's load() took again
        _wait_for(second, stale.exists, "the second build never took torch's lock", log)
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()


# a library is never loaded unchecked: a truncated one kills its loader with SIGBUS before it prints anything


def _built_library() -> Path:
    """This CPU's real library (the ``kernels`` mark has built it for this session)."""
    _, _, name, build_dir = loader._name_and_dir()
    lib = loader._library(build_dir, name)
    if not lib.is_file():
        pytest.skip("the CPU extension is not built here")
    return lib


def _fake_builds(monkeypatch, tmp_path, fail: str = "") -> tuple[Path, list]:
    """Point the loader at ``tmp_path`` with torch's ``load`` faked: it links a small file under the name it
    is given (or raises ``fail``); loading a library in this process is recorded, not done."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_state", {})
    calls = []

    def fake_load(**kwargs):
        calls.append(("build", kwargs["name"]))
        if fail:
            raise RuntimeError(fail)
        out = Path(kwargs["build_directory"]) / f"{kwargs['name']}.so"
        out.write_bytes(b"\x7fELF a freshly linked library")
        return str(out)

    import torch
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append(("load", Path(path))))
    _, _, name, build_dir = loader._name_and_dir()
    build_dir.mkdir(parents=True)
    return loader._library(build_dir, name), calls


def test_a_library_truncated_while_it_linked_is_rebuilt_not_loaded(tmp_path, monkeypatch, capfd):
    """No record and a truncated file (the bug: every command, `looplm kernels build` too, died with SIGBUS):
    a child process tries it, dies, and it is rebuilt instead of loaded."""
    real = _built_library()
    lib, calls = _fake_builds(monkeypatch, tmp_path)
    lib.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    assert loader._load() == (True, "")
    assert calls == [("build", f"{lib.stem}_partial")]  # built, never loaded by this process
    err = capfd.readouterr().err
    assert (
        f"the CPU kernel library {lib} is damaged (it has no record of its size and sha256, and loading it killed a child process with signal 7): rebuilding it"
        in err
    )
    assert (
        lib.read_bytes() == b"\x7fELF a freshly linked library" and not (lib.parent / f"{lib.stem}_partial.so").exists()
    )
    rec = json.loads(loader._record(lib).read_text())
    assert rec["size"] == lib.stat().st_size and rec["sha256"] == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert loader._check(lib) == ""


def test_a_library_that_is_not_what_was_built_is_rebuilt(tmp_path, monkeypatch, capfd):
    lib, calls = _fake_builds(monkeypatch, tmp_path)
    lib.write_bytes(b"\x7fELF" + b"x" * 100)
    loader._write_record(lib)
    lib.write_bytes(b"\x7fELF" + b"x" * 40)  # the disk filled up while another build rewrote it
    assert loader._check(lib) == "it has 44 bytes where 104 were built (truncated or overwritten)"
    lib.write_bytes(b"\x7fELF" + b"y" * 100)
    assert "is not the" in loader._check(lib) and "recorded at its build" in loader._check(lib)
    assert loader._load() == (True, "")
    assert calls == [("build", f"{lib.stem}_partial")]
    assert "is damaged (its sha256" in capfd.readouterr().err


def test_an_empty_library_is_not_built_and_is_rebuilt(tmp_path, monkeypatch):
    """A 0-byte library read "built; could not build" and was never rebuilt."""
    lib, calls = _fake_builds(monkeypatch, tmp_path)
    lib.touch()
    st = loader.status()
    assert (
        not st.built
        and st.reason == f"the library {lib} is damaged (it is empty (0 bytes)): `looplm kernels build` rebuilds it"
    )
    assert loader._load() == (True, "") and calls == [("build", f"{lib.stem}_partial")]
    monkeypatch.setattr(loader, "_state", {})
    assert loader.status().built and loader.status().reason == ""


def test_a_damaged_library_that_cannot_be_rebuilt_says_what_to_delete(tmp_path, monkeypatch):
    lib, calls = _fake_builds(monkeypatch, tmp_path, fail="error: no compiler")
    lib.touch()
    ok, reason = loader._load()
    assert not ok and ("load", lib) not in calls
    assert reason == (
        f"could not build looplm's CPU extension (RuntimeError: error: no compiler; the library there is damaged "
        f"(it is empty (0 bytes)): delete {lib.parent} (rm -r) and run `looplm kernels build`)"
    )


def test_a_build_that_dies_while_linking_leaves_nothing_at_the_librarys_name(tmp_path, monkeypatch):
    """torch links into its output directly: it links under another name, renamed into place once whole; a
    leftover partial file is removed before the next build instead of being taken for up to date."""
    lib, _ = _fake_builds(monkeypatch, tmp_path)
    import torch.utils.cpp_extension as cpp

    def dies_linking(**kwargs):
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").write_bytes(b"\x7fELF trunc")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cpp, "load", dies_linking)
    ok, reason = loader._load()
    assert not ok and "No space left on device" in reason and not lib.exists()
    seen = []
    monkeypatch.setattr(
        cpp, "load", lambda **kw: seen.append((Path(kw["build_directory"]) / f"{kw['name']}.so").exists())
    )
    with pytest.raises(RuntimeError, match="the build produced no library"):
        loader._compile(lib.stem, lib.parent, [], "portable")
    assert seen == [False] and not lib.exists()


def test_an_unrecorded_library_that_loads_is_recorded_not_rebuilt(tmp_path, monkeypatch):
    """Libraries built before records were kept: a child process loads it, and it is recorded and used."""
    real = _built_library()
    lib, calls = _fake_builds(monkeypatch, tmp_path)
    lib.write_bytes(real.read_bytes())
    assert loader.status().built  # status never starts a child
    assert loader._load() == (True, "") and calls == [("load", lib)]
    assert json.loads(loader._record(lib).read_text())["size"] == real.stat().st_size


def test_kernels_build_cli_rebuilds_an_empty_library(tmp_path):
    """End to end with no compiler (CXX pointing nowhere): the command prints the reason and what to
    delete, exits 1, instead of dying with SIGBUS or 'built; could not build'."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-compiler"), PATH="/usr/bin:/bin")
    env.pop("LOOPLM_CPU_KERNELS", None)
    name_dir = subprocess.run(
        [
            sys.executable,
            "-c",
            "from looplm.kernels import loader; n = loader._name_and_dir(); print(n[3] / (n[2] + '.so'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    lib = Path(name_dir)
    lib.parent.mkdir(parents=True)
    lib.touch()
    r = subprocess.run(
        [sys.executable, "-m", "looplm.cli", "kernels", "build"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr
    assert "is damaged (it is empty (0 bytes)): rebuilding it" in r.stderr
    assert f"delete {lib.parent} (rm -r)" in r.stdout + r.stderr
