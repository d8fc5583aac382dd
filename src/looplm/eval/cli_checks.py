"""Checks of command-line values shared by ``looplm eval ...`` and ``looplm bench adaptive``: each returns the
messages of what is wrong (empty when nothing is), so a command gathers every one and raises a single
:class:`~looplm.dataclass_util.ConfigError` before it loads a model or reads data."""

from __future__ import annotations

from pathlib import Path

__all__ = ["at_least", "device_errors", "out_dir_errors", "out_file_errors", "loops_errors"]


def at_least(minimum: int, **flags) -> list[str]:
    """``--flag: must be an integer >= minimum`` for each ``flag=value`` below it (``None``: not given, fine).
    Keyword names are the flags with ``_`` for ``-`` (``batch_size`` -> ``--batch-size``)."""
    return [
        f"--{name.replace('_', '-')}: must be an integer >= {minimum}, got {v}"
        for name, v in flags.items()
        if v is not None and v < minimum
    ]


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` that is a file (so nothing can be created under it)."""
    for p in path.parents:
        if p.exists():
            return p if not p.is_dir() else None
    return None


def out_dir_errors(flag: str, path: str | None) -> list[str]:
    """``path`` can be a directory written into (it is created if missing)."""
    if path is None:
        return []
    p = Path(path)
    if p.exists() and not p.is_dir():
        return [f"{flag} {path!r}: exists and is not a directory; give a directory (created if missing)"]
    blocker = _file_above(p)
    if blocker is not None:
        return [f"{flag} {path!r}: {str(blocker)!r} is a file, so the directory cannot be created under it"]
    return []


def out_file_errors(flag: str, path: str | None) -> list[str]:
    """``path`` can be written as a file (an existing file is replaced; its directory must exist)."""
    if path is None:
        return []
    p = Path(path)
    if p.is_dir():
        return [f"{flag} {path!r}: is a directory; give a file name (e.g. {str(p / 'report.json')!r})"]
    blocker = _file_above(p)
    if blocker is not None:
        return [f"{flag} {path!r}: {str(blocker)!r} is a file, not a directory"]
    if not p.parent.is_dir():
        return [f"{flag} {path!r}: its directory {str(p.parent)!r} does not exist; create it first"]
    return []


def device_errors(flag: str, spec: str, allow_auto: bool = True) -> list[str]:
    """``spec`` names a device this machine has (``auto``, ``cpu``, ``cuda``, ``cuda:N``)."""
    import torch

    if allow_auto and spec == "auto":
        return []
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        return [f"{flag}: {spec!r} is not a device; use {'auto, ' if allow_auto else ''}cpu, cuda or cuda:N"]
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            return [f"{flag} {spec}: no CUDA device is available here; use cpu"]
        if dev.index is not None and dev.index >= n:
            return [f"{flag} {spec}: there are {n} CUDA device(s), cuda:0 to cuda:{n - 1}"]
    elif dev.type != "cpu":
        return [f"{flag} {spec}: only cpu and cuda devices are supported"]
    return []


def loops_errors(flag: str, loops, K: int, allow_deep: bool) -> list[str]:
    """Loop counts ``loops`` (ints) on a model trained with ``K``: each >= 1, and at most 64 x K unless
    ``allow_deep`` (:data:`looplm.decode.exits.DEEP_LOOPS_FACTOR`)."""
    from ..decode.exits import DEEP_LOOPS_FACTOR

    errs = []
    bad = [r for r in loops if r < 1]
    if bad:
        errs.append(f"{flag}: loop counts must be >= 1, got {bad[0]}")
    deep = [r for r in loops if r > DEEP_LOOPS_FACTOR * K]
    if deep and not allow_deep:
        errs.append(
            f"{flag}: {max(deep)} loops is more than {DEEP_LOOPS_FACTOR}x the model's trained K = {K} (at most "
            f"{DEEP_LOOPS_FACTOR * K} without asking); pass --allow-deep to run that deep"
        )
    return errs
