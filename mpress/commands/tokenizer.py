"""`mpress tokenizer`: train a small byte-level BPE from local text files with the
`tokenizers` package and write its tokenizer.json, for `data.tokenizer` of a text job.

The documents are read as `data.kind: text` reads them (`mpress/runtime/text/corpus.py`):
a .txt file is one document, a .jsonl file one per line (its `--text-key` field), a
directory every .txt/.jsonl file under it; `--python-stdlib` takes this Python's standard
library's top-level .py files. The vocabulary holds the 256 byte symbols, `<|endoftext|>`
and merges up to `--vocab-size` ids. A train config's `data.tokenizer: train` does the
same at start-up (and caches the result), so a job needs no separate step.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mpress.commands.flags import EXIT_STATUS, HelpFormatter
from mpress.errors import UserError
from mpress.runtime.data_config import SOURCE_PYTHON_STDLIB
from mpress.runtime.text.corpus import Corpus, find_corpus
from mpress.runtime.text.tokenizer import load_tokenizer, train_bpe

EPILOG = """\
examples:
    mpress tokenizer --files notes.txt corpus/ --vocab-size 512 --out tokenizer.json
    mpress tokenizer --python-stdlib --vocab-size 512 --out stdlib-bpe.json

""" + EXIT_STATUS


def register(subparsers: Any) -> None:
    """Add the `tokenizer` subcommand to the `mpress` parser."""
    parser = subparsers.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer from local text files",
        description="Train a byte-level BPE (tokenizers) from local .txt/.jsonl files and write its tokenizer.json.",
        epilog=EPILOG, formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--files", nargs="+", metavar="PATH", help=".txt/.jsonl files or directories of them")
    source.add_argument("--python-stdlib", action="store_true",
                        help="this Python's standard library's top-level .py files")
    parser.add_argument("--text-key", default="text", help="the field of .jsonl lines that holds the text")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (at least 257)")
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    parser.set_defaults(func=run)


def corpus_of(args: argparse.Namespace) -> Corpus:
    """The documents `--files` or `--python-stdlib` name, files in the order given."""
    if args.python_stdlib:
        return find_corpus(None, source=SOURCE_PYTHON_STDLIB, text_key=args.text_key)
    files: list[Path] = []
    for path in args.files:
        files.extend(find_corpus(path, text_key=args.text_key).files)
    return Corpus(tuple(files), args.text_key)


def run(args: argparse.Namespace) -> int:
    """Train and write the tokenizer; print one line with its size."""
    corpus = corpus_of(args)
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out: {out} is a directory; name the tokenizer.json to write")
    train_bpe(corpus.documents(), vocab_size=args.vocab_size, out=out)
    tokenizer = load_tokenizer(out)
    print(f"mpress tokenizer: {out}: byte-level BPE of {tokenizer.vocab_size} ids from {len(corpus.files)} files "
          f"(<|endoftext|> = {tokenizer.eot_id})")
    return 0
