"""looplm's data layer: tokenizers, document sources, the shuffle/pack pipeline, memmap shards.

Quick use::

    from looplm.data import DataConfig, build_stream, load_tokenizer
    cfg = DataConfig(source="stdlib", seq_len=256)
    tok = load_tokenizer(cfg.tokenizer)               # "byte": 259 ids, no files needed
    stream = build_stream(cfg, tok)                   # infinite, shuffled, exactly resumable
    x = stream.next_batch(8)                          # LongTensor [8, 256]
    state = stream.state_dict()                       # JSON; store it with the checkpoint

See ``docs/data.md`` for the recipe and the resume contract.
"""

from .config import DataConfig
from .memmap import MemmapStream, read_meta
from .pipeline import (
    Packer,
    Selection,
    ShuffleBuffer,
    TokenStream,
    build_stream,
    iter_val_batches,
    pack_documents,
    shard_batch,
)
from .prepare import prepare_memmap
from .sources import (
    DataError,
    DatasetsSource,
    DocumentSource,
    EmptyCorpusError,
    ListSource,
    make_source,
    resolve_files,
    stdlib_source,
)
from .stream import BatchStream, StreamExhausted
from .tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerMismatchError,
    check_vocab,
    load_tokenizer,
    tokenizer_fingerprint,
    train_bpe,
)

__all__ = [
    "BatchStream",
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "DatasetsSource",
    "DocumentSource",
    "EmptyCorpusError",
    "HFTokenizer",
    "ListSource",
    "MemmapStream",
    "Packer",
    "Selection",
    "ShuffleBuffer",
    "StreamExhausted",
    "TokenStream",
    "Tokenizer",
    "TokenizerMismatchError",
    "build_stream",
    "check_vocab",
    "iter_val_batches",
    "load_tokenizer",
    "make_source",
    "pack_documents",
    "prepare_memmap",
    "read_meta",
    "resolve_files",
    "shard_batch",
    "stdlib_source",
    "tokenizer_fingerprint",
    "train_bpe",
]
