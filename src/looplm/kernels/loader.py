"""Building and loading looplm's CPU extension (``csrc/``): the one place that decides whether it runs here.

Which build a CPU gets (:func:`variant`):

* ``avx512bf16`` — CPUs with AVX512-BF16 (AMX tiles too where present): the GEMV kernels of decoding, the
  fused decode steps, the training ops (attention forward / backward, cross-entropy rows, gradient norm);
* ``avx2`` / ``portable`` — other CPUs (``LOOPLM_CPU_KERNELS=portable`` forces it): the fused decode steps
  with torch's matmul for the products, and the gradient norm; no GEMV or training kernels.

``LOOPLM_CPU_KERNELS=0`` switches the extension off (everything runs the PyTorch reference).

The build is explicit: ``looplm kernels build`` (``make install`` runs it), and ``looplm kernels status``
says whether it is built, which variant, and why not when it cannot run. A process that needs the
extension and finds it unbuilt builds it at first use, saying so on stderr with the time it took
(about a minute on 2 cores). Each build lives in its own directory, named by a digest of the sources,
the compiler flags and the torch version (``looplm_cpu_<variant>_<digest>`` under torch's extension
root, ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``): checkouts with other sources never
rebuild each other's, and a built library is loaded directly, with no lock and no ninja run.

Builds of one directory are serialised by an advisory ``flock`` on ``looplm_build.lock``, which the
kernel releases when its holder dies; so a lock whose holder was killed can never hang the next run.
Under that lock torch's own lock file (``lock``, which a killed build leaves behind and which makes
every later ``torch.utils.cpp_extension.load`` wait forever) is stale by construction and is removed,
with a line saying so. A build that another live process is running is waited for, with a line
naming the lock and its holder, up to ``LOOPLM_KERNELS_BUILD_TIMEOUT`` seconds (default 1800).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..utils import cpuinfo

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("gemv.cpp", "decode.cpp", "attention.cpp", "loss.cpp", "reduce.cpp")
HEADERS = ("gemv.h", "simd.h")
KERNEL_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})

_lock = threading.Lock()
_state: dict = {}  # "ok", "reason", "variant", "kernels", "path", "build_s", "amx"
_enabled = [True]


@dataclass
class KernelStatus:
    """What ``looplm kernels status`` and ``looplm info`` print."""

    built: bool  # the library for this CPU's variant exists on disk
    loaded: bool  # this process has loaded it
    variant: str  # avx512bf16 | avx2 | portable | off
    kernels: bool  # the GEMV and training kernels are in this variant
    path: str  # the build directory
    reason: str  # why the extension does not run here ("" when it does)
    build_seconds: float | None = None  # this process built it, in that long

    def to_dict(self) -> dict:
        return asdict(self)


def switched_off() -> bool:
    """``LOOPLM_CPU_KERNELS=0``."""
    return os.environ.get("LOOPLM_CPU_KERNELS", "1") == "0"


def variant() -> tuple[str, list[str]]:
    """Which build this CPU gets, and its compiler flags (see the module docstring)."""
    flags = cpuinfo.flags()
    omp = ["-fopenmp"] if sys.platform.startswith("linux") else []  # at::parallel_for's OpenMP regions
    if KERNEL_FLAGS <= flags and os.environ.get("LOOPLM_CPU_KERNELS") != "portable":
        return "avx512bf16", ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", *omp]
    if {"avx2", "fma"} <= flags:
        return "avx2", ["-O3", "-mavx2", "-mfma", *omp]
    return "portable", ["-O3", *omp]


def _name_and_dir() -> tuple[str, list[str], str, Path]:
    """``(variant, cflags, name, build directory)``: the name carries a digest of everything the library
    is built from, so a changed source gets a new directory instead of rebuilding a shared one."""
    var, cflags = variant()
    h = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        h.update(f.encode() + b"\0" + (CSRC / f).read_bytes())
    h.update(json.dumps([cflags, torch.__version__, sys.version_info[:2]]).encode())
    name = f"looplm_cpu_{var}_{h.hexdigest()[:12]}"
    return var, cflags, name, extensions_root() / name


def extensions_root() -> Path:
    """Where torch keeps JIT extensions: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py3X_<cpu|cuXY>``
    (``$XDG_CACHE_HOME`` honoured) — torch's own layout, computed here so that ``looplm kernels status`` and
    ``looplm info`` need not import ``torch.utils.cpp_extension`` (and setuptools)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return cache / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_{accel}"


def constant_for_compile(fn):
    """``torch.compiler.assume_constant_result(fn)``: compiled code calls ``fn`` once, at tracing, and keeps
    its answer (a fact of the build). That decorator only sets this attribute on ``fn``, but importing it
    imports dynamo (~1.7 s), which no process that never compiles should pay; the compile tests hold the
    two equal in effect."""
    fn._dynamo_marked_constant = True
    return fn


def _library(build_dir: Path, name: str) -> Path:
    return build_dir / f"{name}.so"


def _say(msg: str) -> None:
    print(f"looplm: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold ``build_dir/looplm_build.lock`` (flock: released by the kernel when its holder dies)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "looplm_build.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        timeout = float(os.environ.get("LOOPLM_KERNELS_BUILD_TIMEOUT", "1800"))
        start, said = time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            waited = time.monotonic() - start
            if waited > timeout:
                raise TimeoutError(
                    f"another process has been building looplm's CPU kernels for {waited:.0f} s (lock {path}, held by "
                    f"pid {_holder(path)}); wait for it, or stop it and run `looplm kernels build`"
                )
            if waited - said >= 30 or (said == 0 and waited >= 2):
                _say(f"waiting for pid {_holder(path)}, which is building the CPU kernels (lock {path}; {waited:.0f} s so far)")
                said = waited
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _compile(name: str, build_dir: Path, cflags: list[str], var: str) -> float:
    """Build the library into ``build_dir`` (the caller holds the build lock); returns the seconds taken."""
    baton = build_dir / "lock"
    if baton.exists():  # torch's own lock: under our flock no build of this directory is running
        _say(f"removed a stale build lock left by a killed build ({baton})")
        baton.unlink()
    _say(f"building the CPU kernels for this CPU ({var}) once (under a minute on 2 cores) ...")
    from torch.utils.cpp_extension import load

    t0 = time.perf_counter()
    load(
        name=name,
        sources=[str(CSRC / f) for f in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    dt = time.perf_counter() - t0
    _say(f"built the CPU kernels in {dt:.1f} s ({build_dir})")
    return dt


def _load() -> tuple[bool, str]:
    try:
        var, cflags, name, build_dir = _name_and_dir()
    except Exception as e:  # no torch cpp_extension support, unreadable sources
        return False, f"cannot locate looplm's CPU extension sources ({type(e).__name__}: {e})"
    _state.update(variant=var, kernels=var == "avx512bf16", path=str(build_dir))
    lib = _library(build_dir, name)
    try:
        built_here = False
        if not lib.exists():
            with _build_lock(build_dir):
                if not lib.exists():  # another process may have built it while we waited
                    _state["build_s"] = _compile(name, build_dir, cflags, var)  # torch's load() also loads it
                    built_here = True
        if not built_here:
            torch.ops.load_library(str(lib))
    except Exception as e:  # no compiler, no ninja, a read-only cache directory, a timeout, ...
        msg = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
        _say(f"the CPU kernels are unavailable, everything runs the PyTorch reference ({type(e).__name__}: {msg})")
        return False, f"could not build looplm's CPU extension ({type(e).__name__}: {msg})"
    from . import ops

    ops.register_fakes()
    return True, ""


def load_extension() -> bool:
    """Load (building it once if needed) looplm's CPU extension; ``True`` where it runs (thread-safe).
    ``False`` without loading anything while ``LOOPLM_CPU_KERNELS=0``."""
    if switched_off():
        return False
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _state["ok"], _state["reason"] = _load()
    return _state["ok"] and _enabled[0]


@constant_for_compile
def extension_available() -> bool:
    """Whether the extension runs here (the fused decode steps on any CPU with a compiler); loads it."""
    return load_extension()


@constant_for_compile
def kernels_available() -> bool:
    """Whether the GEMV and training kernels run here (the ``avx512bf16`` build); loads the extension."""
    return load_extension() and _state.get("kernels", False)


def amx() -> bool:
    """Whether the 2-16-row bf16 GEMV runs on AMX tiles here (CPU flags and the process's permission to
    use them; decided once)."""
    if "amx" not in _state:
        if not load_extension() and "ok" not in _state:
            return False
        _state["amx"] = bool(_state["ok"] and _state.get("kernels") and torch.ops.looplm_cpu.amx_ready())
    return _state["amx"]


@constant_for_compile
def mkl_gemm_ready() -> bool:
    """The AVX-512 build is loaded and torch links the MKL GEMMs its training ops call (the attention
    forward / backward and ``mm_f32``)."""
    if "mkl" not in _state:
        if not load_extension() and "ok" not in _state:
            return False
        _state["mkl"] = bool(_state["ok"] and _state.get("kernels") and torch.ops.looplm_cpu.attention_backward_ready())
    return _state["mkl"] and _enabled[0]


def unavailable_reason() -> str:
    """Why the kernels do not run here (empty where they all do)."""
    if switched_off():
        return "switched off by LOOPLM_CPU_KERNELS=0"
    load_extension()
    if not _state["ok"]:
        return _state["reason"]
    if not _enabled[0]:
        return "switched off with looplm.kernels.loader.enabled(False)"
    if not _state.get("kernels", False):
        missing = KERNEL_FLAGS - cpuinfo.flags()
        why = f"this CPU lacks {', '.join(sorted(missing))}" if missing else "LOOPLM_CPU_KERNELS=portable"
        return f"{why}: the portable build runs the fused decode steps, with torch's matmul for the products"
    return ""


@contextlib.contextmanager
def enabled(on: bool):
    """Switch the extension's paths on or off inside a ``with`` block (benchmarks compare both in one
    process): off, the availability checks say no and every dispatch point runs its reference
    (:func:`looplm.dispatch.reference_only`)."""
    from .. import dispatch

    prev, _enabled[0] = _enabled[0], on
    try:
        with contextlib.nullcontext() if on else dispatch.reference_only():
            yield
    finally:
        _enabled[0] = prev


def status(load: bool = False) -> KernelStatus:
    """Where the extension stands, without building it unless ``load``."""
    if load:
        load_extension()
    if switched_off():
        return KernelStatus(False, False, "off", False, "", "switched off by LOOPLM_CPU_KERNELS=0")
    var, _, name, build_dir = _name_and_dir()
    built = _library(build_dir, name).exists()
    loaded = bool(_state.get("ok"))
    if loaded:
        reason = unavailable_reason()
    elif "ok" in _state:
        reason = _state["reason"]
    else:
        reason = "" if built else "not built yet: run `looplm kernels build` (under a minute on 2 cores)"
    return KernelStatus(built, loaded, var, var == "avx512bf16", str(build_dir), reason, _state.get("build_s"))


__all__ = [
    "KernelStatus", "amx", "enabled", "extension_available", "kernels_available", "load_extension", "mkl_gemm_ready",
    "status", "switched_off", "unavailable_reason", "variant",
]  # fmt: skip
