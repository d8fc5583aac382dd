"""The explicit build of looplm's CPU extension (looplm/kernels/loader.py): one directory per source version,
a lock whose dead holder never hangs the next run, torch's stale lock removed, status and its reasons."""

from __future__ import annotations

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
    monkeypatch.setattr(loader, "_state", {"ok": False, "reason": "could not build looplm's CPU extension (OSError: no compiler)"})
    assert loader.status().reason == "could not build looplm's CPU extension (OSError: no compiler)"


def test_kernels_status_cli(tmp_path):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("LOOPLM_CPU_KERNELS", None)
    out = subprocess.run([sys.executable, "-m", "looplm.cli", "kernels", "status"], env=env, capture_output=True, text=True, check=True).stdout
    assert "not built yet: run `looplm kernels build`" in out and str(tmp_path) in out
    env["LOOPLM_CPU_KERNELS"] = "0"
    out = subprocess.run([sys.executable, "-m", "looplm.cli", "info", "tiny-llama"], env=env, capture_output=True, text=True, check=True).stdout
    assert "CPU kernels         off (switched off by LOOPLM_CPU_KERNELS=0)" in out


def _start_build(tmp_path: Path, log: str) -> subprocess.Popen:
    """A real `looplm kernels build` into ``tmp_path`` (its own process group), stderr to ``tmp_path/log``."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("LOOPLM_CPU_KERNELS", None)
    with open(tmp_path / log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "looplm.cli", "kernels", "build"], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip


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
        _wait_for(first, lambda: list(tmp_path.glob("looplm_cpu_*/lock")), "the build never took torch's lock", tmp_path / "first.err")
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
