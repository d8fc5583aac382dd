"""What the CPU is: its model name and instruction-set flags, read once from ``/proc/cpuinfo`` (Linux).

One reader (model name, vendor, flags) for the trainer's ``precision: auto`` (native bf16?), the decode kernels' build check
(AVX512-BF16?) and every benchmark header. Elsewhere (macOS, Windows) the name is ``None`` and the
flags are empty, so every feature that needs a flag stays off.
"""

from __future__ import annotations

import functools


@functools.cache
def _read() -> tuple[str | None, frozenset[str], str | None]:
    name, flags, vendor = None, frozenset(), None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name is None:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("vendor_id") and vendor is None:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
                if name is not None and flags and vendor is not None:
                    break
    except OSError:
        pass
    return name, flags, vendor


def model_name() -> str | None:
    """The CPU's ``model name`` (``None`` where ``/proc/cpuinfo`` is absent or lacks one)."""
    return _read()[0]


def flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_tile``, ...); empty where unknown."""
    return _read()[1]


def vendor() -> str | None:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...; ``None`` where unknown)."""
    return _read()[2]
