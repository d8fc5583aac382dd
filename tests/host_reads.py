"""A dispatch mode that records every op which reads a tensor's value on the host (on CUDA: a
synchronisation): ``.item()`` / ``bool()`` / ``int()`` (``aten::_local_scalar_dense``), ``nonzero``,
``masked_select``, ``equal``, ``unique``, tensor-sized ``repeat_interleave``, and indexing with a bool mask
(which calls ``nonzero`` inside the op)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::equal",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::argwhere",
}
_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class HostReads(TorchDispatchMode):
    """``with HostReads() as r: ...`` -> ``r.reads``: the names of the ops that read a value on the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _ALWAYS:
            self.reads.append(name)
        elif name == "aten::repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
            self.reads.append(f"{name}.{func._overloadname}")
        elif name in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                self.reads.append(f"{name} (a bool mask)")
        return func(*args, **(kwargs or {}))
