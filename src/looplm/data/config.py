"""``DataConfig``: where documents come from, how they are tokenized, shuffled, packed and split.

Build it from a dict with :func:`looplm.dataclass_util.from_dict` (unknown keys, wrong types and
the checks of :meth:`DataConfig.validate` are all reported in one ``ConfigError``)::

    from looplm.dataclass_util import from_dict
    cfg = from_dict(DataConfig, {"source": "files", "paths": ["corpus/*.jsonl"], "seq_len": 1024})

Sources (``source``):

* ``"stdlib"`` -- the embedded corpus of Python standard-library docstrings (no files needed);
* ``"files"`` -- local ``.txt`` / ``.jsonl`` / ``.parquet`` files, globs or directories in ``paths``
  (``format`` picks the reader, ``"auto"`` = by file extension); an entry ``"hf:org/name"`` reads a
  Hugging Face hub dataset instead;
* ``"hf"`` -- a hub dataset ``hf_name`` (with ``hf_config`` / ``hf_split``), streamed;
* ``"memmap"`` -- a directory written by ``looplm data prepare`` (``paths: [dir]``); the same as
  ``source: files`` + ``format: memmap``.

Rows (jsonl, parquet, hub) whose ``text_field`` is missing or null: ``missing_text: error`` (the
default) stops with the file, the number of such rows and the line of the first one;
``missing_text: skip`` skips them with a warning.

Validation split (``split="val"``), first rule that applies:

1. ``val_paths`` -- separate validation files (or a memmap directory); training uses all documents;
2. ``hf_val_split`` -- another split of the same hub dataset;
3. ``val_first_n > 0`` -- the first N documents of the source are validation, training skips them;
4. ``val_every_nth`` -- every N-th document (1-based: the N-th, 2N-th, ...) is validation.
   ``None`` (the default) means 50; ``0`` means "no validation split".
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("stdlib", "files", "hf", "memmap")
FORMATS = ("auto", "text", "jsonl", "parquet", "memmap")
SPLIT_MODES = ("document", "blank_lines", "lines")
MISSING_TEXT_POLICIES = ("error", "skip")  # what a row without text is: see looplm.data.sources
DEFAULT_VAL_EVERY_NTH = 50


@dataclass
class DataConfig:
    """Configuration of the data pipeline (see the module docstring for the meaning of each source)."""

    source: str = "stdlib"  # "stdlib" | "files" | "hf" | "memmap"
    paths: list[str] = field(default_factory=list)  # files, globs, directories; or "hf:org/name"
    format: str = "auto"  # "auto" | "text" | "jsonl" | "parquet" | "memmap"
    text_field: str = "text"  # jsonl field / parquet column / hub dataset column holding the text
    missing_text: str = (
        "error"  # rows whose text_field is missing or null: "error" (count + first line) | "skip" (warn)
    )
    split_mode: str = "document"  # .txt files: "document" (one file = one doc) | "blank_lines" | "lines"
    hf_name: str | None = None  # hub dataset, e.g. "HuggingFaceFW/fineweb-edu"
    hf_config: str | None = None  # hub dataset config ("name" argument of load_dataset)
    hf_split: str = "train"
    hf_val_split: str | None = None  # e.g. "validation": the val split comes from there
    tokenizer: str = "byte"  # "byte" | path to tokenizer.json | tokenizer dir | hub name
    seq_len: int = 512  # tokens per packed row (input and target: the model shifts internally)
    shuffle_buffer: int = 10000  # documents; 0 or 1 = no shuffling
    seed: int = 42
    val_paths: list[str] = field(default_factory=list)
    val_every_nth: int | None = None  # None = 50 unless another validation rule is set; 0 = none
    val_first_n: int = 0
    max_docs: int | None = None  # read at most this many documents of the source (per epoch)

    # ------------------------------------------------------------------ derived values
    @property
    def kind(self) -> str:
        """The effective source kind: ``stdlib``, ``files``, ``hf`` or ``memmap``."""
        if self.source == "memmap" or self.format == "memmap":
            return "memmap"
        if self.source == "files" and self.paths and all(p.startswith("hf:") for p in self.paths):
            return "hf"
        return self.source

    def holdout(self) -> tuple[str, int]:
        """How the validation split is made: ``(rule, n)``.

        ``rule`` is one of ``"paths"``, ``"hf_split"``, ``"first_n"``, ``"every_nth"``, ``"none"``.
        """
        if self.val_paths:
            return "paths", 0
        if self.hf_val_split and self.kind == "hf":
            return "hf_split", 0
        if self.val_first_n > 0:
            return "first_n", self.val_first_n
        n = DEFAULT_VAL_EVERY_NTH if self.val_every_nth is None else self.val_every_nth
        return ("every_nth", n) if n > 0 else ("none", 0)

    # ------------------------------------------------------------------ checks
    def validate(self) -> list[str]:
        """Return one message per problem (empty list = valid)."""
        errs: list[str] = []
        if self.source not in SOURCES:
            errs.append(f"source: must be one of {list(SOURCES)}, got {self.source!r}")
        if self.format not in FORMATS:
            errs.append(f"format: must be one of {list(FORMATS)}, got {self.format!r}")
        if self.split_mode not in SPLIT_MODES:
            errs.append(f"split_mode: must be one of {list(SPLIT_MODES)}, got {self.split_mode!r}")
        if self.source in ("files", "memmap") and not self.paths:
            errs.append(f"paths: source {self.source!r} needs at least one path (file, glob or directory)")
        if self.source == "stdlib" and self.paths:
            errs.append("paths: must be empty for source 'stdlib' (set source: files to read files)")
        if self.source == "memmap" and self.format not in ("auto", "memmap"):
            errs.append(f"format: source 'memmap' reads prepared shards, format {self.format!r} makes no sense")
        if self.kind == "memmap" and len(self.paths) != 1:
            errs.append(f"paths: a memmap source takes exactly one directory, got {len(self.paths)} paths")
        if self.source == "hf" and not self.hf_name:
            errs.append("hf_name: source 'hf' needs a dataset name, e.g. 'org/name'")
        hf_paths = [p for p in self.paths if p.startswith("hf:")]
        if hf_paths and (len(hf_paths) > 1 or len(self.paths) > 1):
            errs.append("paths: an 'hf:org/name' entry must be the only path (one hub dataset per source)")
        if any(p == "hf:" for p in hf_paths):
            errs.append("paths: 'hf:' needs a dataset name, e.g. 'hf:org/name'")
        if not self.text_field:
            errs.append("text_field: must not be empty")
        if self.missing_text not in MISSING_TEXT_POLICIES:
            errs.append(f"missing_text: must be one of {list(MISSING_TEXT_POLICIES)}, got {self.missing_text!r}")
        if not self.tokenizer:
            errs.append("tokenizer: must not be empty (use 'byte' for the built-in byte tokenizer)")
        if not self.hf_split:
            errs.append("hf_split: must not be empty")
        if self.seq_len < 2:
            errs.append(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.shuffle_buffer < 0:
            errs.append(f"shuffle_buffer: must be >= 0 (0 = no shuffling), got {self.shuffle_buffer}")
        if self.seed < 0:
            errs.append(f"seed: must be >= 0, got {self.seed}")
        if self.val_every_nth is not None:
            if self.val_every_nth < 0 or self.val_every_nth == 1:
                errs.append(
                    f"val_every_nth: must be 0 (no hold-out) or >= 2, got {self.val_every_nth}"
                    " (1 would send every document to validation)"
                )
            elif self.val_every_nth > 0 and (self.val_paths or self.val_first_n > 0):
                errs.append("val_every_nth: set only one validation rule (val_paths, val_first_n or val_every_nth)")
        if self.val_first_n < 0:
            errs.append(f"val_first_n: must be >= 0, got {self.val_first_n}")
        if self.val_first_n > 0 and self.val_paths:
            errs.append("val_first_n: set only one validation rule (val_paths or val_first_n)")
        if self.max_docs is not None and self.max_docs < 1:
            errs.append(f"max_docs: must be >= 1 or null, got {self.max_docs}")
        if self.max_docs is not None and self.val_first_n >= self.max_docs:
            errs.append(
                f"val_first_n: holds out {self.val_first_n} documents but max_docs={self.max_docs} "
                "leaves none for training"
            )
        return errs
