"""Malformed token files and checkpoints, met by the ranks of `mpress train` (real
processes: these are read after the launcher started them)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.malformed.cases import Case, check, params

TRAIN = ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1")

def data(case_id: str, name: str, content: bytes | str, *words: str, xfail: str | None = None) -> Case:
    config = f"model: gpt-tiny\nnum_stages: 1\nsteps: 1\ndata: {{kind: file, path: {name}}}\n"
    return Case(case_id, TRAIN, {"train.yaml": config, name: content}, (name, *words), subprocess=True, xfail=xfail)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


CASES = [
    data("txt-not-an-integer", "t.txt", "1 2 x 4\n", "token 2"),
    data("txt-id-beyond-vocab", "t.txt", " ".join(["3"] * 40) + " 100000\n", "vocab_size"),
    data("txt-negative-id", "t.txt", "1 -2 3\n", ">= 0"),
    data("bin-odd-size", "t.uint16.bin", b"\x01\x00\x02", "whole number"),
    data("npy-floats", "t.npy", _npy(np.ones(100, dtype=np.float32)), "integer"),
    data("npy-pickled-objects", "t.npy", _npy(np.array([{"a": 1}], dtype=object)), "t.npy"),
    data("too-few-tokens", "t.txt", "1 2 3\n", "need at least"),
    data("unknown-suffix", "t.csv", "1,2,3\n", "format"),
    Case("checkpoint-file-is-garbage", TRAIN,
         {"train.yaml": "model: gpt-tiny\nnum_stages: 1\nsteps: 2\ncheckpoint: {dir: ck, resume: true}\n",
          "ck/step000000/rank0.pt": b"this is not a checkpoint"},
         ("rank0.pt", "no complete checkpoint"), subprocess=True),
    Case("checkpoint-file-is-empty", TRAIN,
         {"train.yaml": "model: gpt-tiny\nnum_stages: 1\nsteps: 2\ncheckpoint: {dir: ck, resume: true}\n",
          "ck/step000000/rank0.pt": b""},
         ("rank0.pt", "no complete checkpoint"), subprocess=True),
    Case("checkpoint-dir-under-a-file", TRAIN,
         {"train.yaml": "model: gpt-tiny\nnum_stages: 1\nsteps: 1\ncheckpoint: {dir: afile/ck}\n", "afile": "x"},
         ("checkpoint.dir", "afile")),
]


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_data_or_checkpoint(case: Case, tmp_path) -> None:
    check(case, tmp_path)
