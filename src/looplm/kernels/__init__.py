"""looplm's fast paths: everything that is not the plain-PyTorch reference model.

* ``csrc/`` — the C++ extension (GEMV kernels of decoding, fused decode steps, CPU training ops);
* :mod:`~looplm.kernels.loader` — building and loading it: the variant for this CPU, availability and the
  reason when it cannot run, the explicit build (``looplm kernels build``) and its lock;
* :mod:`~looplm.kernels.ops` — the ops' fake kernels for ``torch.compile``;
* :mod:`~looplm.kernels.gemv` — the decode-time products (one-token steps of linear layers);
* :mod:`~looplm.kernels.gemm` — bf16 CPU training products in the measured fastest split (``TunedLinear``,
  stacked q/k/v and gate/up);
* :mod:`~looplm.kernels.training` — the attention backward, the chunked loss rows, the gradient norm;
* :mod:`~looplm.kernels.decode` / :mod:`~looplm.kernels.stateloop` — fused one-token steps of blocks, stacks,
  residual state mixers and StateLoop's update and reads.

Nothing in the model imports this package. Its implementations plug into the dispatch points of the
reference code (:mod:`looplm.dispatch`) when :func:`load` is called — by ``generate``, the trainer, the
benchmarks, or you — for models on a CPU. Every test of a fast path holds it to the reference it replaces.
"""

from __future__ import annotations

import threading

import torch

from .loader import KernelStatus, status, switched_off

__all__ = ["KernelStatus", "build", "load", "status"]

_lock = threading.Lock()
_loaded = [False]


def load(device: torch.device | str | None = "cpu") -> bool:
    """Register looplm's CPU fast paths with :mod:`looplm.dispatch` (once per process), for models on
    ``device``; loads the extension, building it first if it is not built (one line on stderr says so
    and how long it took). A no-op for other devices (the CUDA paths are the reference's own: SDPA,
    ``mamba_ssm``) and under ``LOOPLM_CPU_KERNELS=0``. Returns whether the extension runs here."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu":
        return False
    with _lock:
        if not _loaded[0]:
            from . import gemm

            gemm.register()  # TunedLinear's stacked products are PyTorch code: whatever the extension
            if not switched_off():  # (switched off: nothing more now; a later load() without it registers the rest)
                from . import decode, gemv, stateloop, training
                from .loader import extension_available

                training.register()
                if extension_available():
                    gemv.register()
                    decode.register()
                    stateloop.register()
                _loaded[0] = True
    from .loader import extension_available

    return extension_available()


def build() -> KernelStatus:
    """Build (if needed) and load the extension for this CPU now; returns :func:`status`."""
    from .loader import load_extension

    load_extension()
    return status()
