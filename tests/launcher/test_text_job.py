"""A text job end to end on 2 CPU ranks through `mpress train`: local .txt/.jsonl documents, a
byte-level BPE trained at start-up, training and validation losses on rank 0's output;
a second run reads the cache and repeats the first's losses exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.launcher.test_train_launcher import ROOT, launch, losses

pytestmark = pytest.mark.slow
pytest.importorskip("tokenizers")


def corpus(root: Path) -> Path:
    """Twenty small documents: sixteen .txt files and a .jsonl of four."""
    docs = root / "docs"
    docs.mkdir()
    for i in range(16):
        (docs / f"doc{i:02d}.txt").write_text(f"# note {i}\n" + f"value_{i % 5} = value_{(i + 1) % 5} + {i}\n" * 30)
    (docs / "extra.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 80}) + "\n" for i in range(4)))
    return docs


def config(tmp: Path) -> dict:
    model = yaml.safe_load((ROOT / "configs/models/gpt-tiny.yaml").read_text())
    model.update(name="gpt-tiny-300", vocab_size=300)
    (tmp / "model.yaml").write_text(yaml.safe_dump(model))
    return {"model": str(tmp / "model.yaml"), "schedule": "1f1b", "num_stages": 2, "microbatch_size": 2,
            "num_microbatches": 2, "steps": 4, "plan": "auto", "hardware": "cpu-local", "seed": 1, "log_every": 1,
            "data": {"kind": "text", "path": str(corpus(tmp)), "tokenizer": "train", "val_fraction": 0.2,
                     "cache_dir": str(tmp / "cache")},
            "eval_every": 2, "eval_batches": 2}


def val_losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step (\d+): val loss (\S+)  ppl (\S+)$", stdout, re.M)}


def test_a_text_job_trains_evaluates_reuses_its_cache_and_resumes(tmp_path):
    cfg = config(tmp_path)
    first = launch(cfg, tmp_path, nproc=2, timeout=300, torchrun=False)
    assert first.returncode == 0, first.stderr[-3000:]
    data_line = next(line for line in first.stdout.splitlines() if line.startswith("data: "))
    assert re.search(r"\d+ \+ \d+ documents, \d+ training \+ \d+ validation windows, vocabulary 2[5-9]\d "
                     r"\(tokens cached now\); evaluating \d batches", data_line), data_line
    assert sorted(val_losses(first.stdout)) == [1, 3]
    assert sorted(losses(first.stdout)) == [0, 1, 2, 3]
    cache = tmp_path / "cache"
    assert len(list(cache.glob("bpe-300-*.json"))) == 1 and len(list(cache.glob("tokens-*.npy"))) == 1
    # the same job stopped after 2 steps with a checkpoint, then resumed: it reads the
    # cache, and steps 2 and 3 see the batches and give the losses of the uninterrupted run
    ckpt = {"dir": str(tmp_path / "ckpt")}
    second = launch({**cfg, "steps": 2, "checkpoint": ckpt}, tmp_path, nproc=2, timeout=300, torchrun=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(tokens from the cache)" in second.stdout
    assert losses(second.stdout) == {k: v for k, v in losses(first.stdout).items() if k < 2}
    resumed = launch({**cfg, "checkpoint": {**ckpt, "resume": True}}, tmp_path, nproc=2, timeout=300, torchrun=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 2" in resumed.stdout
    assert losses(resumed.stdout) == {k: v for k, v in losses(first.stdout).items() if k >= 2}
    assert val_losses(resumed.stdout) == {3: val_losses(first.stdout)[3]}
