"""The documents of a text data set: local `.txt` / `.jsonl` files, a directory of them, or
this Python's standard library (`data.source: python-stdlib`).

A `.txt` (and a `.py` of the standard library) file is one document; a `.jsonl` file
holds one document per non-empty line, the string in its `text_key` field. Files are
taken in sorted path order, so the documents' order is the same on every machine that
holds the same files. `content_hash` keys the caches: it covers the files' bytes (not
their paths or times), so moving the data keeps the cache and editing it invalidates it.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mpress.errors import UserError

TEXT_SUFFIXES = (".txt", ".jsonl")
"""File kinds a `data.path` directory contributes."""


@dataclass(frozen=True)
class Corpus:
    """The files of a text data set and how to read them."""

    files: tuple[Path, ...]
    """The files, in the order their documents are taken (sorted paths)."""
    text_key: str = "text"
    """The field of a .jsonl line that holds the document."""

    def documents(self) -> Iterator[str]:
        """Every document, file by file (see the module docstring). Raises `UserError`
        naming the file and line for a .jsonl line that is not JSON or lacks `text_key`."""
        for path in self.files:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, self.text_key)
            else:
                yield _read(path)

    def content_hash(self) -> str:
        """sha256 (hex) of every file's bytes, in order, and `text_key`."""
        h = hashlib.sha256(f"text_key={self.text_key}\n".encode())
        for path in self.files:
            data = path.read_bytes()
            h.update(f"{len(data)}\n".encode())
            h.update(data)
        return h.hexdigest()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise UserError(f"{path}:{number}: no string field {key!r} (set data.text_key to the field "
                            "that holds the text)")
        yield record[key]


def stdlib_files() -> tuple[Path, ...]:
    """The top-level `*.py` files of this Python's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = tuple(sorted(root.glob("*.py")))
    if not files:
        raise UserError(f"data.source: python-stdlib: no .py files in {root}")
    return files


def find_corpus(path: str | Path | None, *, source: str | None = None, text_key: str = "text") -> Corpus:
    """The corpus of `data.path` (a .txt/.jsonl file or a directory searched recursively
    for them) or of `data.source`. Raises `UserError` naming the path when there is
    nothing to read."""
    if source is not None:
        return Corpus(stdlib_files(), text_key)
    if path is None:
        raise UserError("data: kind: text needs a path or a source")
    p = Path(path)
    if p.is_dir():
        files = tuple(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
                             and ".mpress-cache" not in f.parts))
        if not files:
            raise UserError(f"{p}: no {' or '.join(TEXT_SUFFIXES)} files in this directory")
        return Corpus(files, text_key)
    if not p.is_file():
        raise UserError(f"{p}: no such file or directory")
    if p.suffix not in TEXT_SUFFIXES:
        raise UserError(f"{p}: a text file must be .txt (one document) or .jsonl (one per line), got "
                        f"{p.suffix or '(no suffix)'!r}")
    return Corpus((p,), text_key)


def default_cache_dir(path: str | Path | None, source: str | None) -> Path:
    """Where caches go without `data.cache_dir`: `.mpress-cache` beside the data (in the
    directory, or the file's directory), or ~/.cache/mpress/text for a `source`."""
    if source is not None or path is None:
        return Path.home() / ".cache" / "mpress" / "text"
    p = Path(path)
    return (p if p.is_dir() else p.parent) / ".mpress-cache"
