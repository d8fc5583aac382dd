"""Process groups and data parallelism (DDP or FSDP2), applied from outside the model code.

Launch with ``torchrun`` (it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...)::

    torchrun --nproc_per_node 8 -m looplm.cli train CONFIG.yaml --out runs/x --set train.parallel=fsdp

A plain ``python -m looplm.cli train`` is a world of one process and wraps nothing.

Backends: NCCL when training on CUDA, gloo on CPU.

FSDP2 and looping
-----------------
The core blocks run ``K`` times per forward. FSDP2 (``torch.distributed.fsdp.fully_shard``)
handles a module that is called several times: each call all-gathers the block's parameters
(and frees them after, with ``reshard_after_forward=True``) and the gradient contributions of all
calls are accumulated before the reduce-scatter. ``fsdp_granularity: core`` shards each core /
prelude / coda block as its own unit plus the root (embedding, head, rule); this trades one
all-gather per block *per loop iteration* for low memory. ``fsdp_granularity: root`` makes the
whole model one unit (one all-gather per step, the memory of a replicated model during the
step) — use it when the per-iteration all-gathers dominate. The multi-process tests compare both
DDP and FSDP2 with a single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "init_distributed",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "wrap_model",
    "unwrap_model",
    "all_reduce_mean",
    "all_reduce_max",
    "barrier",
    "cleanup",
    "broadcast_object",
]


def is_distributed() -> bool:
    """Whether a process group is up (``torchrun`` with more than one process, after :func:`init_distributed`)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank: from the process group, else from ``torchrun``'s ``RANK`` (0 without one).

    The environment covers the time before :func:`init_distributed` and after :func:`cleanup`.
    """
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    """The number of processes: from the process group, else ``WORLD_SIZE`` (1 without ``torchrun``)."""
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Rank 0: the process that writes files and prints."""
    return get_rank() == 0


@dataclass
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size`` processes, on ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError(
                "train.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'"
            )  # a config error
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment (if any).

    Returns a ``DistInfo``; without ``WORLD_SIZE`` (or with 1) no process group is created.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if get_world_size() <= 1:
        return DistInfo(0, 1, 0, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not is_distributed():
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def cleanup() -> None:
    """Destroy the process group (if this process created one)."""
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of ``value`` over ranks (identity without a process group)."""
    if is_distributed() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def all_reduce_max(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over ranks (``value`` itself without a process group): one 1-element
    all-reduce, e.g. so that every rank stops at the step where any rank was asked to."""
    if is_distributed() and dist.get_world_size() > 1:
        t = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return int(value)


def broadcast_object(obj, src: int = 0):
    """``obj`` from rank ``src`` on every rank (identity without a process group)."""
    if is_distributed() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return obj


def wrap_model(
    model: nn.Module, mode: str, info: DistInfo, fsdp_granularity: str = "core", find_unused_parameters: bool = False
) -> nn.Module:
    """Wrap ``model`` for data parallelism.

    Args:
        mode: ``"ddp"`` (``DistributedDataParallel``), ``"fsdp"`` (FSDP2 ``fully_shard``) or ``"none"``.
            With a single process nothing is wrapped.
        fsdp_granularity: ``"core"`` (each block its own FSDP unit, plus the root) or ``"root"``.
        find_unused_parameters: DDP option; needed when some parameters may get no gradient in a
            step (truncated backprop through a random number of loops).

    The model must already be on ``info.device``. FSDP2 modifies ``model`` in place (parameters
    become sharded ``DTensor`` s, names are unchanged) and returns it.
    """
    if not info.distributed or mode == "none":
        if info.distributed and mode == "none":
            raise ValueError(
                f"train.parallel is 'none' but {info.world_size} processes were launched; "
                "use 'ddp' or 'fsdp', or launch a single process"
            )
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids, find_unused_parameters=find_unused_parameters)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        if fsdp_granularity == "core":
            for stack_name in ("prelude", "core", "coda"):
                stack = getattr(model, stack_name, None)
                if stack is None:
                    continue
                blocks = getattr(getattr(stack, "stack", stack), "blocks", None)
                for block in blocks or []:
                    fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown parallel mode {mode!r}; use 'ddp', 'fsdp' or 'none'")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 modules are their own unwrapped form)."""
    return (
        model.module
        if hasattr(model, "module") and isinstance(model, torch.nn.parallel.DistributedDataParallel)
        else model
    )
