"""Tokenizers behind one small interface: byte-level, trained BPE, or a saved ``tokenizer.json``.

Every tokenizer here has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
a ``fingerprint`` string (part of the token-cache key: two tokenizers with the same fingerprint
give the same ids) and ``save(directory)``, which writes a Hugging Face ``tokenizer.json``.

Spec strings (:func:`parse_tokenizer_spec`):

``"byte"``
    UTF-8 bytes, vocab 256, nothing to train (the default).
``"bpe:4096"`` (or ``"bpe"`` for 4096)
    byte-level BPE trained with the ``tokenizers`` library on the *training* split only
    (:func:`train_bpe`; :func:`kernelmix.data.prepare_dataset` does it and saves the result beside
    the tokenized data).
a path
    a directory holding ``tokenizer.json`` or the file itself (:func:`load_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

DEFAULT_BPE_VOCAB = 4096
TOKENIZER_FILE = "tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of kernelmix needs from a tokenizer."""

    vocab_size: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | Path) -> Path: ...


# ---------------------------------------------------------------------------------------------
# Byte level


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (the alphabet of
    byte-level BPE), so byte ids can be written in a Hugging Face ``tokenizer.json``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_hf_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids are exactly the UTF-8 bytes (BPE with no merges)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256). Encoding is plain ``str.encode``: no training, no
    unknown tokens, any text round-trips. ``decode`` replaces an incomplete UTF-8 sequence (e.g. a
    generation cut mid-character) with U+FFFD instead of failing."""

    vocab_size = 256
    fingerprint = "byte-v1"
    spec = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids as a uint8 array (fast path used when tokenizing corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        """Write an equivalent Hugging Face ``tokenizer.json`` (ids = bytes), which
        :func:`load_tokenizer` recognises as byte level again."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        _byte_level_hf_tokenizer().save(str(path))
        return path

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizers (trained BPE or loaded)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (the Rust library, not ``transformers``) behind our interface.

    ``encode`` adds no special tokens (documents are separated by position ids, not by BOS/EOS);
    the fingerprint is a hash of the tokenizer's JSON, so any change to vocab, merges or
    normalisation gives a new cache key."""

    def __init__(self, tokenizer, spec: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, ensure_ascii=False)
        self.fingerprint = "hf-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]
        self.spec = spec or self.fingerprint

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (in parallel in the Rust library)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        return path

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, spec={self.spec!r})"


def train_bpe(
    texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB, *, min_frequency: int = 2, show_progress: bool = False
) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenisation, the 256 bytes always in the
    vocabulary, so any text can be encoded) on ``texts``. Pass the training split only."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256:
        raise ValueError(f"BPE vocab_size must be an int ≥ 256 (the byte alphabet), got {vocab_size!r}")
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, spec=f"bpe:{vocab_size}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` (or a directory holding one). A saved :class:`ByteTokenizer`
    comes back as a :class:`ByteTokenizer`."""
    path = Path(path).expanduser()
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"directory {str(path)!r} has no {TOKENIZER_FILE}" if path.is_dir() else f"{str(path)!r} does not exist"
        raise ValueError(
            f"cannot load tokenizer: {where}; give a directory holding a Hugging Face {TOKENIZER_FILE} "
            "(e.g. one written by tokenizer.save(dir)) or the file itself"
        )
    from tokenizers import Tokenizer as HFTok

    try:
        tok = HFTok.from_file(str(file))
    except Exception as error:  # the Rust library raises a bare Exception on bad JSON
        raise ValueError(
            f"cannot load tokenizer from {str(file)!r}: {error}; it must be a Hugging Face tokenizers JSON file"
        ) from error
    if json.loads(tok.to_str()) == json.loads(_byte_level_hf_tokenizer().to_str()):
        return ByteTokenizer()
    return HFTokenizer(tok, spec=str(file))


_BPE_SPEC = re.compile(r"^bpe(?::(\d+))?$")


def parse_tokenizer_spec(spec: str | Path) -> tuple[str, int | Path | None]:
    """``"byte"`` → ("byte", None); ``"bpe:N"`` → ("bpe", N); an existing path → ("path", Path)."""
    if isinstance(spec, Path):
        kind = ("path", spec)
    else:
        text = str(spec).strip()
        match = _BPE_SPEC.match(text.lower())
        if text.lower() == "byte":
            return "byte", None
        if match:
            vocab = int(match.group(1)) if match.group(1) else DEFAULT_BPE_VOCAB
            if vocab < 256:
                raise ValueError(f"BPE vocab size must be ≥ 256 (the byte alphabet), got {text!r}; e.g. 'bpe:4096'")
            return "bpe", vocab
        kind = ("path", Path(text).expanduser())
    if not kind[1].exists():
        raise ValueError(
            f"unknown tokenizer spec {str(spec)!r} (use 'byte', 'bpe:VOCAB' such as 'bpe:4096', or the path of a "
            f"directory holding {TOKENIZER_FILE} or of the file itself)"
        )
    return kind


def get_tokenizer(spec: "str | Path | Tokenizer") -> Tokenizer:
    """A ready tokenizer from a spec that needs no training: ``"byte"`` or a path (or a tokenizer
    object, returned as is). ``"bpe:N"`` must be trained on a corpus: use
    :func:`kernelmix.data.prepare_dataset` (or :func:`train_bpe`)."""
    if isinstance(spec, Tokenizer):
        return spec
    kind, value = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        raise ValueError(
            f"tokenizer {spec!r} must be trained on a corpus first: use prepare_dataset(corpus, tokenizer={spec!r}) "
            "(which trains it on the training split) or train_bpe(texts, vocab_size)"
        )
    return load_tokenizer(value)


__all__ = [
    "DEFAULT_BPE_VOCAB",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "bytes_to_unicode",
    "get_tokenizer",
    "load_tokenizer",
    "parse_tokenizer_spec",
    "train_bpe",
]
