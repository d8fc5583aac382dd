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

A library is never loaded unchecked: loading a truncated one (a build killed, or a disk full, while it
linked) kills the process with SIGBUS before it can print anything. So torch links it under another name
(``<name>_partial.so``), which is renamed into place only once it has loaded, and its size and sha256 are
recorded next to it (``<name>.json``). A library whose file does not match its record, or an empty one, is
rebuilt; one with no record (built before records were kept, or a build killed between the two renames) is
loaded first in a child process, recorded if it loads and rebuilt if not. When it cannot be rebuilt the
message names the directory to delete.
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
        return "avx512bf16", [
            "-O3",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mamx-tile",
            "-mamx-bf16",
            *omp,
        ]
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


def _record(lib: Path) -> Path:
    """The size and sha256 of ``lib`` as built, written next to it."""
    return lib.with_suffix(".json")


def _digest(lib: Path) -> tuple[int, str]:
    data = lib.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def _write_record(lib: Path, built: Path | None = None) -> None:
    """Record the size and sha256 of ``lib`` (or of ``built``, the file about to be renamed to it), written
    under a temporary name and renamed: never half a record."""
    size, sha = _digest(built or lib)
    rec, tmp = _record(lib), _record(lib).with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"file": lib.name, "size": size, "sha256": sha}) + "\n")
    os.replace(tmp, rec)


def _child_loads(lib: Path) -> str:
    """Load ``lib`` in a child process (a truncated library kills its loader with SIGBUS); "" when it
    loads, else why not."""
    import subprocess

    code = "import sys, torch; torch.ops.load_library(sys.argv[1])"
    env = dict(os.environ, LOOPLM_CPU_KERNELS="0")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(lib)], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"a child process could not load it ({type(e).__name__}: {e})"
    if r.returncode == 0:
        return ""
    if r.returncode < 0:
        return f"loading it killed a child process with signal {-r.returncode}"
    last = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    return f"a child process could not load it ({last})"


def _check(lib: Path, child: bool = True) -> str:
    """Whether ``lib`` may be loaded: "" when it matches its record, "missing" when there is none, else
    what is wrong with it. With no record, ``child`` loads it in a child process and records it if that
    works; without ``child`` an unrecorded, non-empty library passes (``looplm kernels status`` must
    stay cheap)."""
    try:
        size = lib.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size == 0:
        return "it is empty (0 bytes)"
    try:
        rec = json.loads(_record(lib).read_text())
        want_size, want_sha = int(rec["size"]), str(rec["sha256"])
    except FileNotFoundError:
        rec = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its record {_record(lib)} is unreadable ({type(e).__name__}: {e})"
    if rec is None:
        if not child:
            return ""
        why = _child_loads(lib)
        if why:
            return f"it has no record of its size and sha256, and {why}"
        with contextlib.suppress(OSError):  # a read-only cache: it loads, it is just not recorded
            _write_record(lib)
        return ""
    got_size, got_sha = _digest(lib)
    if got_size != want_size:
        return f"it has {got_size} bytes where {want_size} were built (truncated or overwritten)"
    if got_sha != want_sha:
        return f"its sha256 {got_sha[:12]}... is not the {want_sha[:12]}... recorded at its build"
    return ""


def _discard(lib: Path) -> None:
    """Remove a library that must not be loaded, and its record."""
    for f in (lib, _record(lib)):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


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
                _say(
                    f"waiting for pid {_holder(path)}, which is building the CPU kernels (lock {path}; {waited:.0f} s so far)"
                )
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
    # torch links straight into its output, so a kill or a full disk mid-link leaves a truncated file there:
    # it links under another name, renamed into place once it has loaded (and so is whole)
    partial = _library(build_dir, f"{name}_partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()  # a killed build's: never taken for up to date
    built = load(
        name=partial.stem,
        sources=[str(CSRC / f) for f in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    built = Path(built) if isinstance(built, str) else partial  # torch names it <name>_v<n> on a rebuild in one process
    if not built.is_file() or built.stat().st_size == 0:
        raise RuntimeError(f"the build produced no library at {built}")
    lib = _library(build_dir, name)
    _discard(lib)
    _write_record(lib, built)  # the record first: a library in place always has one
    os.replace(built, lib)
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
    bad = ""
    try:
        built_here = False
        bad = _check(lib)
        if bad:
            with _build_lock(build_dir):
                bad = _check(lib)  # another process may have built it while we waited
                if bad:
                    if bad != "missing":
                        _say(f"the CPU kernel library {lib} is damaged ({bad}): rebuilding it")
                        _discard(lib)
                    _state["build_s"] = _compile(name, build_dir, cflags, var)  # torch's load() also loads it
                    built_here, bad = True, ""
        if not built_here:
            torch.ops.load_library(str(lib))
    except Exception as e:  # no compiler, no ninja, a read-only cache directory, a timeout, ...
        msg = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
        if bad and bad != "missing":  # never loaded; say what to remove by hand
            msg += f"; the library there is damaged ({bad}): delete {build_dir} (rm -r) and run `looplm kernels build`"
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
    lib = _library(build_dir, name)
    bad = _check(lib, child=False)
    built = not bad
    loaded = bool(_state.get("ok"))
    if loaded:
        reason = unavailable_reason()
    elif "ok" in _state:
        reason = _state["reason"]
    elif not bad:
        reason = ""
    elif bad == "missing":
        reason = "not built yet: run `looplm kernels build` (under a minute on 2 cores)"
    else:
        reason = f"the library {lib} is damaged ({bad}): `looplm kernels build` rebuilds it"
    return KernelStatus(built, loaded, var, var == "avx512bf16", str(build_dir), reason, _state.get("build_s"))


__all__ = [
    "KernelStatus",
    "amx",
    "enabled",
    "extension_available",
    "kernels_available",
    "load_extension",
    "mkl_gemm_ready",
    "status",
    "switched_off",
    "unavailable_reason",
    "variant",
]
