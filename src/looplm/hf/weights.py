"""The weight files of a Hugging Face style model directory, read exactly as the format names them.

``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (both at once: ambiguous, refused;
other ``*.safetensors`` files are never read, with a warning); tensor names and shapes from the headers only
(:func:`read_shapes`), so that a model's missing, unexpected or mis-shaped tensors are refused in one error
(:func:`refuse_mismatch`) before any weight is loaded. Shared by ``looplm import hf``'s readers
(:mod:`looplm.hf.importer`: looplm exports, transformers models; :mod:`looplm.hf.public`: Ouro, Huginn), with
the importers' other checks made before anything is read: JSON files naming themselves (:func:`read_json`), an
output that is not the source (:func:`refuse_overlap`), a loop count and a size that can run here
(:func:`preflight`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint_io import MAX_LOOPS

__all__ = [
    "INDEX_FILE",
    "MAX_IMPORT_LOOPS",
    "WEIGHTS_FILE",
    "preflight",
    "read_json",
    "read_shapes",
    "refuse_dangling",
    "refuse_mismatch",
    "refuse_overlap",
    "weight_files",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; a ``ValueError`` naming the file when it is not one (also for nesting too
    deep for Python's parser, which raises ``RecursionError``: no model config nests more than a few levels)."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{what} {str(path)!r} is not valid JSON ({e}); the directory is corrupted or incomplete"
        ) from e
    except RecursionError as e:
        raise ValueError(
            f"{what} {str(path)!r} nests its arrays / objects too deeply to be read (a corrupted or "
            "hostile file; no real config nests more than a few levels)"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} is not a JSON object")
    return data


_read_json = read_json  # the name the importers used first


def refuse_overlap(src: str | Path, out: str | Path, verb: str = "import") -> None:
    """Refuse an output directory ``out`` that is the source ``src`` or inside it (symlinks resolved): writing
    there would replace the source's own files (``config.json``, ``model.safetensors``) while reading them, or
    mix new files into the directory being read — even with ``--overwrite``, which is for an earlier output."""
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or s in o.parents:
        where = "is the source" if o == s else f"is inside the source {str(s)!r}"
        raise ValueError(
            f"output directory {str(out)!r} {where}: {verb} would overwrite or mix into the files it "
            "reads (even with --overwrite); pick a directory outside it"
        )


def refuse_dangling(*paths: Path) -> None:
    """A ``FileNotFoundError`` naming the first of ``paths`` that is a symlink to nothing (a half-copied Hugging
    Face cache, whose files link into its blob store): it exists as a name, so "missing" would mislead."""
    for p in paths:
        if p.is_symlink() and not p.exists():
            raise FileNotFoundError(
                f"{str(p)!r} is a symlink to {str(p.resolve())!r}, which does not exist (a cache "
                "or copy that lost its target files): copy the real files"
            )


def weight_files(src: str | Path) -> list[Path]:
    """The safetensors files of a model directory, exactly as the format names them: ``model.safetensors``,
    or the shards listed in ``model.safetensors.index.json``. Both at once is ambiguous and refused;
    other ``*.safetensors`` files (a stray backup) are never read, with a warning."""
    import warnings

    src = Path(src)
    index, single = src / INDEX_FILE, src / WEIGHTS_FILE
    refuse_dangling(index, single, *(p for p in src.glob("*.safetensors") if p.is_symlink()))
    if index.is_file() and single.is_file():
        raise ValueError(
            f"{str(src)!r} holds both {WEIGHTS_FILE} and {INDEX_FILE} (shards): which weights are meant is ambiguous; "
            "remove the one that is stale"
        )
    if index.is_file():
        weight_map = _read_json(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"weight index {str(index)!r} has no weight_map (tensor name -> shard file)")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or not n.endswith(".safetensors")]
        if bad:
            raise ValueError(
                f"weight index {str(index)!r} names shards that are not *.safetensors files beside it: {bad[:5]}"
            )
        refuse_dangling(*(src / n for n in names))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise FileNotFoundError(f"weight index {str(index)!r} lists shard(s) that are missing: {missing[:5]}")
        files = [src / n for n in names]
    elif single.is_file():
        files = [single]
    else:
        found = sorted(p.name for p in src.glob("*.safetensors"))
        hint = (
            f"; it has {found}, which the format does not name: rename the one meant to {WEIGHTS_FILE}" if found else ""
        )
        raise FileNotFoundError(f"{str(src)!r} has no {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    stray = sorted(p.name for p in src.glob("*.safetensors") if p not in files)
    if stray:
        warnings.warn(
            f"{str(src)!r}: ignoring {stray} (not named by {files[0].name if len(files) == 1 else INDEX_FILE})",
            stacklevel=2,
        )
    return files


def read_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of safetensors ``files`` from their headers only (no tensor data read); a
    truncated or corrupted file, or a tensor in two shards, is refused naming the file."""
    from safetensors import safe_open

    from ..checkpoint_io import CheckpointError

    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                found = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
        except Exception as e:  # safetensors' own error type: a bad header, a file shorter than its header says
            raise CheckpointError(f"weight file {str(f)!r} is truncated or corrupted and cannot be read ({e})") from e
        for k, shape in found.items():
            if k in shapes:
                raise ValueError(
                    f"tensor {k!r} is in two weight files, {where[k]} and {f.name}: which one is meant is ambiguous"
                )
            shapes[k], where[k] = shape, f.name
    return shapes


def _listing(names, n: int = 8) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def refuse_mismatch(src, missing=(), unexpected=(), mismatched=(), what: str = "the model") -> None:
    """Raise one ``ValueError`` listing tensors ``src`` lacks, has too many of, or has in the wrong shape
    (``mismatched``: ``(name, file shape, model shape)``), so nothing is written with random stand-ins."""
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_listing(unexpected)}")
    if mismatched:
        shown = [f"{k} {list(a)} (expected {list(b)})" for k, a, b in sorted(mismatched)[:8]]
        problems.append(f"mis-shaped {len(mismatched)}: " + ", ".join(shown) + (" ..." if len(mismatched) > 8 else ""))
    if problems:
        raise ValueError(
            f"the weights in {str(src)!r} do not fit {what} ({'; '.join(problems)}); nothing was written. Check that "
            "config.json belongs to these weights and that no weight file is missing or stale"
        )


# a loop count past this at import is refused unless asked for (allow_deep / --allow-deep): the bound at load
MAX_IMPORT_LOOPS = MAX_LOOPS


def preflight(
    cfg, dtype=None, *, where: str, loops_field: str = "n_loops", allow_deep: bool = False, allow_large: bool = False
) -> None:
    """Checks of an imported model config before any model is built or weight read: a loop count past
    :data:`MAX_IMPORT_LOOPS` (``allow_deep`` lets it through) and parameters that cannot fit in this machine's
    available memory at ``dtype`` (``allow_large``; :func:`looplm.factory.check_fits`)."""
    import torch

    from ..factory import check_fits, parameter_bytes

    dtype = torch.float32 if dtype is None else dtype
    if cfg.n_loops > MAX_IMPORT_LOOPS and not allow_deep:
        raise ValueError(
            f"{where}: {loops_field} = {cfg.n_loops:,} loops, more than {MAX_IMPORT_LOOPS:,} (every token would run "
            f"the core {cfg.n_loops:,} times: decoding would not finish). If it is meant, pass allow_deep=True "
            "(--allow-deep)"
        )
    check_fits(
        parameter_bytes(cfg, dtype),
        f"{where} ({cfg.name}, {str(dtype).removeprefix('torch.')})",
        allow=allow_large,
        flag="--allow-large",
    )
