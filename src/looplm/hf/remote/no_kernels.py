"""What an export carries in place of ``looplm.kernels`` (as ``looplm_kernels.py``; see ``looplm/hf/bundle.py``).

looplm's fast paths are compiled C++ (``looplm/kernels/csrc``, built per CPU by ``looplm kernels build``), so
an export does not carry them: its model runs the plain-PyTorch reference of every dispatch point. The one
call the model code makes into that package — ``generate`` asking to register the CPU fast paths before
decoding — is answered here: there are none to register. With looplm installed (the same source as the
export's), the export runs on looplm itself and gets them (``modeling_looplm.looplm_implementation``).
"""

from __future__ import annotations

__all__ = ["load"]


def load(device=None) -> bool:
    """Register no fast path (an export carries none); returns ``False``: no extension runs here."""
    return False
