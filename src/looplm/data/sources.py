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

**Rows without text** (jsonl / parquet / hub rows whose ``text_field`` is missing or null) are an
error by default (``DataConfig.missing_text: error``): a :class:`DataError` names the file, how
many of its rows lack the field and the line of the first one. ``missing_text: skip`` skips such
rows instead, with a warning naming the first one and, at the end of each pass, their count. A
source whose rows have no such field at all, a file that is not UTF-8 or not valid JSON, and a
source of only empty files are errors that name the file (and line) too.
"""

from __future__ import annotations

import bz2
import glob as _glob
import gzip
import json
import lzma
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

from .config import MISSING_TEXT_POLICIES, DataConfig

TEXT_EXTS = (".txt", ".text", ".md")
JSON_EXTS = (".jsonl", ".json", ".ndjson")
PARQUET_EXTS = (".parquet",)
COMPRESSION_EXTS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_BUILDER_OF_FORMAT = {"text": "text", "jsonl": "json", "parquet": "parquet"}
_SAMPLE_BY = {"document": "document", "blank_lines": "paragraph", "lines": "line"}


class DataError(ValueError):
    """The data cannot be read as configured (the message names the file and what to change)."""


class EmptyCorpusError(DataError):
    """A source (or a split of it) contains no usable document."""


class DataWarning(UserWarning):
    """Something in the data was skipped (``missing_text: skip``)."""


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
        missing_text: ``"error"`` (default): a row whose ``text_field`` is missing or null raises a
            :class:`DataError` with the count and the first line; ``"skip"``: such rows count as
            empty documents (skipped by the pipeline), with a :class:`DataWarning`.
    """

    def __init__(
        self,
        path: str,
        data_files: list[str] | None = None,
        name: str | None = None,
        split: str = "train",
        text_field: str = "text",
        builder_kwargs: dict | None = None,
        strip_newlines: bool = False,
        max_docs: int | None = None,
        missing_text: str = "error",
    ):
        if missing_text not in MISSING_TEXT_POLICIES:
            raise ValueError(f"missing_text must be one of {list(MISSING_TEXT_POLICIES)}, got {missing_text!r}")
        self.path = path
        self.data_files = data_files
        self.name = name
        self.split = split
        self.text_field = text_field
        self.builder_kwargs = dict(builder_kwargs or {})
        self.strip_newlines = strip_newlines
        self.max_docs = max_docs
        self.missing_text = missing_text
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
        if all(os.path.getsize(f) == 0 for f in self.data_files):
            raise EmptyCorpusError(
                f"{self.description}: the file(s) are empty (0 bytes); point data.paths at the corpus"
            )
        try:  # the json builder reads the first file's start already here
            return datasets.load_dataset(self.path, data_files=self.data_files, split="train", streaming=True, **kwargs)
        except (UnicodeDecodeError, ValueError, OSError, EOFError) as e:
            where = (
                locate_unreadable(self.data_files, jsonl=self.path == "json") if self.path in ("text", "json") else None
            )
            if where is None:
                raise DataError(f"{self.description}: cannot read the data ({type(e).__name__}: {str(e)[:300]})") from e
            raise DataError(where) from e

    def iter_from(self, start: int) -> Iterator[str]:
        if self.max_docs is not None and start >= self.max_docs:
            return
        ds = self._load()
        if start:
            ds = ds.skip(start)
        if self.max_docs is not None:
            ds = ds.take(self.max_docs - start)
        field = self.text_field
        skipped = 0
        rows = self._read_rows(ds)
        for index, row in enumerate(rows, start):
            if field not in row:
                raise DataError(
                    f"{self.description}: the rows have no field {field!r}; their fields are {sorted(row)} "
                    f"(document {index}). Set data.text_field (--text-field) to the field that holds the text."
                )
            text = row[field]
            if text is None:
                if self.missing_text == "error":
                    raise DataError(self._missing_text_message(index))
                if skipped == 0:
                    warnings.warn(
                        f"skipping rows without text (data.missing_text: skip): {self._missing_text_where(index)}",
                        DataWarning,
                        stacklevel=2,
                    )
                skipped += 1
                text = ""  # an empty document: the pipeline skips it, the source position still counts it
            elif not isinstance(text, str):
                raise DataError(
                    f"{self.description}: field {field!r} of document {index} is a "
                    f"{type(text).__name__}, not a string; set data.text_field (--text-field) to a text field"
                )
            yield text.strip("\r\n") if self.strip_newlines else text
        if skipped:
            warnings.warn(
                f"{self.description}: skipped {skipped} row(s) without a {field!r} value in this pass "
                "(data.missing_text: skip)",
                DataWarning,
                stacklevel=2,
            )

    def _read_rows(self, ds) -> Iterator[dict]:
        """The rows of ``ds``; a file that cannot be decoded or parsed becomes a :class:`DataError` naming it."""
        rows = iter(ds)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except (UnicodeDecodeError, ValueError, OSError, EOFError) as e:  # pyarrow's ArrowInvalid is a ValueError
                line_based = self.path in ("text", "json") and self.data_files  # local text / jsonl files
                where = locate_unreadable(self.data_files, jsonl=self.path == "json") if line_based else None
                if where is None:
                    raise DataError(
                        f"{self.description}: cannot read the data ({type(e).__name__}: {str(e)[:300]})"
                    ) from e
                raise DataError(where) from e
            yield row

    def _missing_text_where(self, index: int) -> str:
        """Where the first row without text is: ``FILE: N row(s) ..., the first at line L`` or its index."""
        found = first_row_without(self.data_files or [], self.text_field) if self.path == "json" else None
        if found is None:
            return f"{self.description}: document {index} has no {self.text_field!r} value (missing or null)"
        file, line, count, fields = found
        return (
            f"{file}: {count} row(s) have no {self.text_field!r} value (missing or null), the first at "
            f"line {line} (its fields: {fields})"
        )

    def _missing_text_message(self, index: int) -> str:
        return (
            f"{self._missing_text_where(index)}. Fix those rows, set data.text_field (--text-field) to the field "
            "that holds the text, or set data.missing_text: skip (--missing-text skip) to skip such rows with a warning."
        )


# ------------------------------------------------------------------------------ locating problems
def _open_binary(path: str):
    """``path`` opened for reading bytes, decompressed by its extension (``None`` if we cannot)."""
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    if name.endswith(COMPRESSION_EXTS):
        return None
    return open(path, "rb")


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` of a (possibly compressed) file; nothing if unreadable."""
    f = _open_binary(path)
    if f is None:
        return
    with f:
        yield from enumerate(f, 1)


def locate_unreadable(files: Sequence[str], jsonl: bool) -> str | None:
    """The first line of ``files`` that is not UTF-8 (or, for ``jsonl``, not valid JSON), described
    as ``"FILE line N is not valid UTF-8 ..."``; ``None`` if every line reads fine."""
    for path in files:
        try:
            found = _first_unreadable_line(path, jsonl)
        except (OSError, EOFError, lzma.LZMAError) as e:  # a damaged or mislabelled .gz / .bz2 / .xz
            return (
                f"{path} cannot be read as a {path.rsplit('.', 1)[-1]} file ({type(e).__name__}: {e}); "
                "fix or re-download it, or drop the compression extension if it is not compressed"
            )
        if found is not None:
            return found
    return None


def _first_unreadable_line(path: str, jsonl: bool) -> str | None:
    """The first line of ``path`` that is not UTF-8 (or not JSON, for ``jsonl``), described; ``None`` if none."""
    for n, raw in _lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"{path} line {n} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8"
            )
        if jsonl and line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path} line {n} is not valid JSON ({e.msg} at column {e.colno}); one JSON object per line is expected"
    return None


def first_row_without(files: Sequence[str], field: str) -> tuple[str, int, int, list[str]] | None:
    """For jsonl ``files``: ``(file, line, count, fields)`` of the first file with rows whose ``field``
    is missing or null -- the first such row's line and fields, and how many such rows that file
    has. ``None`` if there is none, or the files are not one JSON object per line."""
    for path in files:
        first, count = None, 0
        try:
            for n, raw in _lines(path):
                if not raw.strip():
                    continue
                row = json.loads(raw)
                if not isinstance(row, dict):
                    return None
                if row.get(field) is None:
                    count += 1
                    first = first or (n, sorted(row))
        except (ValueError, OSError):  # not jsonl (a JSON array, a broken line): the caller says less
            return None
        if first is not None:
            return path, first[0], count, first[1]
    return None


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
            found = sorted(str(p) for p in Path(pat_x).rglob("*") if p.is_file() and format_of(str(p)) is not None)
            if not found:
                raise FileNotFoundError(f"directory {pat!r} contains no .txt/.md/.jsonl/.json/.parquet files")
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
    return DatasetsSource(
        _BUILDER_OF_FORMAT[fmt],
        data_files=files,
        text_field=text_field,
        builder_kwargs=kwargs,
        strip_newlines=(fmt == "text" and cfg.split_mode != "document"),
        max_docs=max_docs,
        missing_text=cfg.missing_text,
    )


def hub_source(
    name: str, config: str | None, split: str, cfg: DataConfig, max_docs: int | None = None
) -> DatasetsSource:
    """A :class:`DatasetsSource` streaming a Hugging Face hub dataset."""
    if not name:
        raise ValueError("a hub dataset needs a name, e.g. 'hf:org/name'")
    return DatasetsSource(
        name,
        data_files=None,
        name=config,
        split=split,
        text_field=cfg.text_field,
        max_docs=max_docs,
        missing_text=cfg.missing_text,
    )


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
