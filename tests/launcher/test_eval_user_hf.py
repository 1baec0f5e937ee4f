"""`eval_every` for a user's own module and a Hugging Face model on text, through the
documented torchrun command on 2 CPU ranks under the plan made at start-up for a budget
that makes the first stage compact (its rank's capacity on CPU): the user's
module (`tests.support.user_model:make_text_lm`, whose embedding skips every block to the
head, so two tensors cross each stage boundary) and a GPT-2 built from a config.json train
on text files with a BPE trained from them, and validate every 2 steps. The validation
loss the pipeline reports forward-only at the last step equals a plain forward of the
whole model, rebuilt from the last checkpoint, over the same held-out batches."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from mpress.launcher.checkpoints.checkpoint import read_step
from mpress.models import lm_loss
from mpress.models.hf_model import load_hf_model
from mpress.runtime.data import batches
from mpress.runtime.data_config import DataConfig
from mpress.runtime.text.dataset import build_text_data
from tests.launcher.test_train_launcher import ROOT, launch
from tests.support.user_model import make_text_lm

pytestmark = pytest.mark.slow
pytest.importorskip("tokenizers")

STEPS = 4
EVAL_BATCHES = 2
MICROBATCH = 2
NUM_MICROBATCHES = 2


def corpus(tmp: Path) -> Path:
    root = tmp / "corpus"
    root.mkdir()
    for i in range(16):
        (root / f"d{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}  # {'ab' * i}\n" * (6 + i % 5))
    return root


def data_section(tmp: Path) -> dict:
    return {"kind": "text", "path": str(tmp / "corpus"), "tokenizer": "train", "cache_dir": str(tmp / "cache"),
            "val_fraction": 0.25}


def train(tmp: Path, model: dict, budget: str) -> tuple[list[dict], dict]:
    """Train under `model`'s keys with a `budget` per device; (the metrics lines, the last
    checkpoint's state)."""
    config = {**model, "schedule": "1f1b", "num_stages": 2, "microbatch_size": MICROBATCH,
              "num_microbatches": NUM_MICROBATCHES, "steps": STEPS, "log_every": 1, "seed": 2,
              "plan": "auto", "hardware": "cpu-local", "device_memory": budget, "optimizer": {"lr": 3e-3, "clip_grad_norm": 1.0},
              "data": data_section(tmp), "eval_every": 2, "eval_batches": EVAL_BATCHES,
              "metrics": str(tmp / "metrics.jsonl"), "checkpoint": {"dir": str(tmp / "ckpt"), "every_steps": STEPS}}
    corpus(tmp)
    res = launch(config, tmp, nproc=2, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    flat = " ".join(res.stdout.split())  # a long run directory wraps the header line
    assert "plan mpress (auto)" in flat and "evaluating 2 batches" in flat, res.stdout
    first = re.search(r"^│\s+0 │\s+0 │\s+([^│]*?)\s+│", res.stdout, re.MULTILINE)
    assert first and first.group(1) != "keep", res.stdout  # the first stage's plan compacts it
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return records, read_step(tmp / "ckpt" / f"step{STEPS - 1:06d}")


def validation_batches(tmp: Path, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out set's first eval batches, as the job built it (the same cache)."""
    cfg = DataConfig(**data_section(tmp))
    val = build_text_data(cfg, seq_len=seq_len, vocab_size=vocab, seed=2).val
    return [batches(val, microbatch_size=MICROBATCH, num_microbatches=NUM_MICROBATCHES, step=j)
            for j in range(EVAL_BATCHES)]


def assert_validated(records: list[dict], expected: float) -> None:
    evaluated = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [step for step, _ in evaluated] == [1, 3]
    assert all(math.isfinite(v) for _, v in evaluated)
    assert evaluated[-1][1] == pytest.approx(expected, rel=1e-6, abs=0)


def test_a_user_module_validates_on_text(tmp_path):
    records, state = train(tmp_path, {"module": "tests.support.user_model:make_text_lm",
                                      "layers": ["embed", "blocks.*", "head"]}, "250KB")
    model, _ids, _loss = make_text_lm()
    model.load_state_dict(state["model"])
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in validation_batches(tmp_path, seq_len=8, vocab=300):
            for xm, ym in zip(x.tensor_split(NUM_MICROBATCHES), y.tensor_split(NUM_MICROBATCHES)):
                losses.append(float(lm_loss(model(xm), ym)))
    assert_validated(records, sum(losses) / len(losses))


def test_a_hugging_face_model_validates_on_text(tmp_path):
    pytest.importorskip("transformers")
    config = json.loads((ROOT / "configs/hf/gpt2-tiny.json").read_text())
    config.update(vocab_size=300, bos_token_id=299, eos_token_id=299)  # room for the BPE's 300 ids
    path = tmp_path / "gpt2-300.json"
    path.write_text(json.dumps(config))
    records, state = train(tmp_path, {"hf_config": str(path)}, "1MB")
    hf = load_hf_model(str(path), microbatch_size=MICROBATCH, seed=2)
    chain = hf.module
    chain.load_state_dict(state["model"])
    chain.eval()
    losses = []
    with torch.no_grad():
        for x, _y in validation_batches(tmp_path, seq_len=16, vocab=300):
            for xm in x.tensor_split(NUM_MICROBATCHES):  # a causal LM's targets are its ids (its loss shifts them)
                losses.append(float(hf.loss(chain(xm), xm)))
    assert_validated(records, sum(losses) / len(losses))
