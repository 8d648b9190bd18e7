"""Real text for training and evaluation: corpora, tokenizers, cached token arrays, windows.

    from kernelmix.data import prepare_dataset, WindowSampler, eval_batches

    data = prepare_dataset("pystdlib", "byte")        # or "shakespeare", a dir, glob, .jsonl, .parquet; "bpe:4096"
    sampler = WindowSampler(data.train, seq_len=512, batch_size=8, seed=0)
    batch = sampler.batch(step)                       # the same batch for the same (seed, step, rank)
    loss = model(**batch.model_inputs()).loss
    for batch in eval_batches(data.val, 512, 8): ...  # every validation token predicted once

The pieces, each usable alone:

- :mod:`~kernelmix.data.corpus` — :func:`load_corpus` (built-ins ``pystdlib`` and
  ``shakespeare``, local files), :func:`split_documents` (train/validation by a hash of the
  document name, so validation text is never trained on).
- :mod:`~kernelmix.data.tokenizer` — byte level, BPE trained on the training split, or a saved
  ``tokenizer.json``; spec strings ``"byte"``, ``"bpe:4096"``, a path.
- :mod:`~kernelmix.data.dataset` — :func:`prepare_dataset`: tokenized splits as memory-mapped
  arrays in a cache keyed by corpus, tokenizer and split (``$KERNELMIX_CACHE/data`` or
  ``~/.cache/kernelmix/data``).
- :mod:`~kernelmix.data.sampling` — :class:`WindowSampler` (stateless, resumable, rank-aware),
  :func:`eval_batches`, :func:`loader_throughput`.
- :mod:`~kernelmix.data.windows` — ``[N, T]`` windows of text for pretrained (Hugging Face)
  tokenizers: :func:`text_windows` (the one windowing rule), :func:`split_texts`.
"""

from .corpus import (
    BUILTIN_CORPORA,
    Corpus,
    CorpusFileError,
    Document,
    load_corpus,
    read_text_file,
    split_documents,
    split_key,
    stdlib_files,
)
from .dataset import TokenizedDataset, TokenizedSplit, default_cache_dir, open_dataset, prepare_dataset, token_dtype
from .sampling import IGNORE_INDEX, Batch, WindowSampler, eval_batches, eval_windows, loader_throughput
from .recall import mqar_batch, query_accuracy  # synthetic MQAR sequences (kernelmix recall)
from .windows import load_text_windows, split_texts, text_windows
from .tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer, load_tokenizer, parse_tokenizer_spec,
                        train_bpe)

__all__ = [
    "BUILTIN_CORPORA",
    "IGNORE_INDEX",
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "CorpusFileError",
    "Document",
    "HFTokenizer",
    "TokenizedDataset",
    "TokenizedSplit",
    "Tokenizer",
    "WindowSampler",
    "default_cache_dir",
    "eval_batches",
    "eval_windows",
    "get_tokenizer",
    "load_corpus",
    "load_text_windows",
    "load_tokenizer",
    "loader_throughput",
    "mqar_batch",
    "open_dataset",
    "parse_tokenizer_spec",
    "prepare_dataset",
    "query_accuracy",
    "read_text_file",
    "split_documents",
    "split_texts",
    "split_key",
    "stdlib_files",
    "token_dtype",
    "text_windows",
    "train_bpe",
]
