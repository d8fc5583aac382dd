"""Document sources: iterators of documents (``str``) with an exact, resumable position.

A source's position is simply **the number of documents consumed from it** (counted before any
filtering). ``source.iter_from(n)`` yields document ``n``, ``n+1``, ... so a resumed run continues
at exactly the right document.

* :class:`ListSource` -- documents held in memory (the ``stdlib`` corpus, tests).
* :class:`DatasetsSource` -- local ``.txt`` / ``.jsonl`` / ``.parquet`` files *and* Hugging Face hub
  datasets, all through ``datasets.load_dataset(..., streaming=True)``: ``"json"``, ``"parquet"``
  and ``"text"`` builders for local files, the dataset name for the hub -- the same code path.
  Resuming calls ``IterableDataset.skip(n)``. We deliberately do **not** use ``datasets``' own
  ``shuffle()`` or ``state_dict()``/``load_state_dict()`` resume: it was measured to lose or
  repeat rows across a resume. Shuffling is done by our own :class:`~looplm.data.pipeline.ShuffleBuffer`
  whose state is saved exactly.

:func:`make_source` builds the right source for a :class:`~looplm.data.config.DataConfig`.
"""

from __future__ import annotations

import glob as _glob
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

from .config import DataConfig

TEXT_EXTS = (".txt", ".text", ".md")
JSON_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet",)
COMPRESSION_EXTS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_BUILDER_OF_FORMAT = {"text": "text", "jsonl": "json", "parquet": "parquet"}
_SAMPLE_BY = {"document": "document", "blank_lines": "paragraph", "lines": "line"}


class EmptyCorpusError(ValueError):
    """A source (or a split of it) contains no usable document."""


class DocumentSource(ABC):
    """An ordered, re-readable sequence of documents."""

    #: a short human description (file list, dataset name); stored in the stream state
    description: str = ""

    @property
    def key(self) -> str:
        """Identifies the document sequence; a saved position is only valid for the same key."""
        return self.description

    @abstractmethod
    def iter_from(self, start: int) -> Iterator[str]:
        """Yield the documents with index ``start``, ``start + 1``, ... (raw: may be empty strings)."""

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


class ListSource(DocumentSource):
    """Documents held in a Python list (optionally capped at ``max_docs``)."""

    def __init__(self, docs: Sequence[str], description: str = "list", max_docs: int | None = None):
        self.docs = docs if max_docs is None else docs[:max_docs]
        self.description = description

    def iter_from(self, start: int) -> Iterator[str]:
        docs = self.docs
        return (docs[i] for i in range(start, len(docs)))

    def __len__(self) -> int:
        return len(self.docs)


def stdlib_source(max_docs: int | None = None) -> ListSource:
    """The embedded corpus: docstrings of the installed Python standard library (one per document)."""
    from .stdlib_corpus import collect_stdlib_docs

    return ListSource(collect_stdlib_docs(), description="stdlib", max_docs=max_docs)


class DatasetsSource(DocumentSource):
    """Documents streamed by ``datasets.load_dataset(..., streaming=True)``.

    Args:
        path: the builder (``"json"``, ``"parquet"``, ``"text"``) for local files, or a hub name.
        data_files: the local files (for a builder), in reading order.
        name: the dataset config (hub datasets).
        split: the split to read.
        text_field: the column holding the text (always ``"text"`` for the text builder).
        builder_kwargs: extra ``load_dataset`` arguments (``sample_by`` for text files).
        strip_newlines: strip leading/trailing newlines of each document (paragraph mode).
        max_docs: read at most this many documents.
    """

    def __init__(self, path: str, data_files: list[str] | None = None, name: str | None = None,
                 split: str = "train", text_field: str = "text", builder_kwargs: dict | None = None,
                 strip_newlines: bool = False, max_docs: int | None = None):
        self.path = path
        self.data_files = data_files
        self.name = name
        self.split = split
        self.text_field = text_field
        self.builder_kwargs = dict(builder_kwargs or {})
        self.strip_newlines = strip_newlines
        self.max_docs = max_docs
        self.is_hub = data_files is None
        if self.is_hub:
            self.description = f"hf:{path}" + (f"/{name}" if name else "") + f"[{split}]"
        else:
            self.description = f"{path}:" + ",".join(data_files)

    @property
    def key(self) -> str:
        # file names without directories: a run may resume from another working directory
        if self.is_hub:
            return self.description
        return f"{self.path}:" + ",".join(os.path.basename(f) for f in self.data_files)

    def _load(self):
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                "reading files or hub datasets needs the 'datasets' package: pip install "
                "'looplm[data]' (the built-in 'stdlib' corpus works without it)"
            ) from e
        kwargs = dict(self.builder_kwargs)
        if self.is_hub:
            from .tokenizers import hub_reachable

            offline = os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes")
            if offline or not hub_reachable():
                raise ValueError(
                    f"cannot stream hub dataset {self.path!r}: the Hugging Face hub is not reachable "
                    "(offline, or HF_HUB_OFFLINE=1). Use local files (source: files, paths: [...]) or "
                    "the built-in corpus (source: stdlib)."
                )
            try:
                return datasets.load_dataset(self.path, self.name, split=self.split, streaming=True, **kwargs)
            except Exception as e:
                raise ValueError(
                    f"could not open hub dataset {self.path!r} (config={self.name!r}, split="
                    f"{self.split!r}): {type(e).__name__}: {str(e)[:400]}. Offline? Use local files "
                    "(source: files) or the built-in corpus (source: stdlib)."
                ) from e
        return datasets.load_dataset(self.path, data_files=self.data_files, split="train",
                                     streaming=True, **kwargs)

    def iter_from(self, start: int) -> Iterator[str]:
        if self.max_docs is not None and start >= self.max_docs:
            return
        ds = self._load()
        if start:
            ds = ds.skip(start)
        if self.max_docs is not None:
            ds = ds.take(self.max_docs - start)
        field = self.text_field
        for i, row in enumerate(ds):
            if field not in row:
                raise KeyError(
                    f"{self.description}: document {start + i} has no field {field!r}; its fields are "
                    f"{sorted(row)}. Set data.text_field to the column that holds the text."
                )
            text = row[field]
            if text is None:
                text = ""
            elif not isinstance(text, str):
                raise TypeError(
                    f"{self.description}: field {field!r} of document {start + i} is a "
                    f"{type(text).__name__}, not a string; set data.text_field to a text column"
                )
            yield text.strip("\r\n") if self.strip_newlines else text


# ------------------------------------------------------------------------------ file handling
def _base_ext(path: str) -> str:
    name = path.lower()
    for c in COMPRESSION_EXTS:
        if name.endswith(c):
            name = name[: -len(c)]
            break
    return os.path.splitext(name)[1]


def format_of(path: str) -> str | None:
    """``"text"``, ``"jsonl"`` or ``"parquet"`` from a file's extension (``None`` if unknown)."""
    ext = _base_ext(path)
    if ext in TEXT_EXTS:
        return "text"
    if ext in JSON_EXTS:
        return "jsonl"
    if ext in PARQUET_EXTS:
        return "parquet"
    return None


def resolve_files(patterns: Sequence[str]) -> list[str]:
    """Expand files, globs (``**`` allowed) and directories (recursive) into a sorted file list.

    Order: the patterns in the order given; within a glob or directory, sorted paths. Duplicates
    are dropped. Directories contribute only files with a known extension.

    Raises:
        FileNotFoundError: a pattern matches nothing (``no files match 'data/*.jsonl'``).
    """
    out: list[str] = []
    for pat in patterns:
        pat_x = os.path.expanduser(pat)
        if any(ch in pat_x for ch in "*?["):
            found = sorted(p for p in _glob.glob(pat_x, recursive=True) if os.path.isfile(p))
        elif os.path.isdir(pat_x):
            found = sorted(
                str(p) for p in Path(pat_x).rglob("*") if p.is_file() and format_of(str(p)) is not None
            )
            if not found:
                raise FileNotFoundError(
                    f"directory {pat!r} contains no .txt/.md/.jsonl/.json/.parquet files"
                )
        elif os.path.isfile(pat_x):
            found = [pat_x]
        else:
            found = []
        if not found:
            raise FileNotFoundError(f"no files match {pat!r} (working directory: {os.getcwd()})")
        out.extend(found)
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def file_source(paths: Sequence[str], cfg: DataConfig, max_docs: int | None = None) -> DatasetsSource:
    """A :class:`DatasetsSource` over local files (or one ``hf:org/name`` entry)."""
    if len(paths) == 1 and paths[0].startswith("hf:"):
        return hub_source(paths[0][3:], cfg.hf_config, cfg.hf_split, cfg, max_docs)
    files = resolve_files(paths)
    if cfg.format != "auto":
        fmt = cfg.format
    else:
        fmts = {f: format_of(f) for f in files}
        unknown = [f for f, x in fmts.items() if x is None]
        if unknown:
            raise ValueError(
                f"cannot tell the format of {unknown[0]!r} from its extension; set data.format to "
                "'text', 'jsonl' or 'parquet'"
            )
        kinds = sorted(set(fmts.values()))
        if len(kinds) > 1:
            raise ValueError(
                f"the paths mix file formats {kinds}; use one format per source (e.g. convert the "
                "text files to jsonl) or point paths at one kind only"
            )
        fmt = kinds[0]
    if fmt == "memmap":
        raise ValueError("format 'memmap' is read by MemmapStream, not as documents")
    kwargs: dict = {}
    text_field = cfg.text_field
    if fmt == "text":
        kwargs["sample_by"] = _SAMPLE_BY[cfg.split_mode]
        text_field = "text"
    return DatasetsSource(_BUILDER_OF_FORMAT[fmt], data_files=files, text_field=text_field,
                          builder_kwargs=kwargs, strip_newlines=(fmt == "text" and cfg.split_mode != "document"),
                          max_docs=max_docs)


def hub_source(name: str, config: str | None, split: str, cfg: DataConfig,
               max_docs: int | None = None) -> DatasetsSource:
    """A :class:`DatasetsSource` streaming a Hugging Face hub dataset."""
    if not name:
        raise ValueError("a hub dataset needs a name, e.g. 'hf:org/name'")
    return DatasetsSource(name, data_files=None, name=config, split=split, text_field=cfg.text_field,
                          max_docs=max_docs)


def make_source(cfg: DataConfig, split: str = "train") -> DocumentSource:
    """The document source for ``split`` ("train" or "val") of ``cfg``.

    For ``val`` with a hold-out rule (``val_every_nth`` / ``val_first_n``) this is the *same*
    source as training; the pipeline picks the held-out documents by index.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    kind = cfg.kind
    if kind == "memmap":
        raise ValueError("a memmap source has no documents; use build_stream() / MemmapStream")
    rule, _ = cfg.holdout()
    if split == "val" and rule == "paths":
        return file_source(cfg.val_paths, cfg)
    if kind == "stdlib":
        return stdlib_source(cfg.max_docs)
    if kind == "hf":
        name = cfg.hf_name or cfg.paths[0][3:]
        hf_split = cfg.hf_val_split if (split == "val" and rule == "hf_split") else cfg.hf_split
        return hub_source(name, cfg.hf_config, hf_split, cfg, cfg.max_docs)
    return file_source(cfg.paths, cfg, cfg.max_docs)
