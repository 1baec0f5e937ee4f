"""`mpress tokenizer`: a byte-level BPE from local files, and one-line refusals."""

from __future__ import annotations

import json

import pytest

from mpress.cli import main
from mpress.runtime.text.tokenizer import EOT, load_tokenizer

pytest.importorskip("tokenizers")


def test_trains_from_files_and_directories(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "b.jsonl").write_text(json.dumps({"body": "print('hi')\n" * 40}) + "\n")
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "--files", str(tmp_path / "a.txt"), str(tmp_path / "more"), "--text-key", "body",
                 "--vocab-size", "280", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"mpress tokenizer: {out}: byte-level BPE of ") and "from 2 files" in line
    tok = load_tokenizer(out)
    assert tok.vocab_size <= 280 and tok.backend.id_to_token(tok.eot_id) == EOT


def test_refusals_are_one_line(tmp_path, capsys):
    assert main(["tokenizer", "--files", str(tmp_path / "none"), "--vocab-size", "300", "--out",
                 str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip().endswith("none: no such file or directory")
    (tmp_path / "a.txt").write_text("x")
    assert main(["tokenizer", "--files", str(tmp_path / "a.txt"), "--vocab-size", "100", "--out",
                 str(tmp_path / "t.json")]) == 2
    assert "needs vocab_size >= 257" in capsys.readouterr().err
