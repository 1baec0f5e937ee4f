"""A 7B-class Hugging Face config (the Llama-2-7B shape, `configs/hf/llama-2-7b.json`) is
profiled on fake tensors and planned through the documented commands on this machine,
and its saved bytes equal those of a real run of the same architecture at a small width,
scaled by the shape: every saved tensor of the small run, its dimensions mapped to the
big model's (hidden 24 -> 4096, heads 4 -> 32, head dim 6 -> 128, FFN 44 -> 11008, vocab
56 -> 32000, sequence 10 -> 1024), is the big run's tensor of the same name, and its
bytes scale by the element count. The small run is measured for real (`fake=False`) on
the CPU; the big one is profiled for an A100, whose fused attention kernel also keeps its
RNG state where the CPU's keeps none (`cuda_kernels.py`: flash, two uint64 tensors of
24 B; efficient, when the model passes a mask, two int64 scalars of 16 B).

The time each command takes is printed (`pytest -s`), not asserted.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import yaml

from mpress.hardware.server import load_hardware
from mpress.models.hf_config import HF_CONFIG_DIR
from mpress.static.profile.fake_profile import profile_hf_model
from mpress.static.profile.profile import Profile
from tests.support.documented import run_documented

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BIG_SEQ, SMALL_SEQ, BATCH = 1024, 10, 2
SMALL = {"hidden_size": 24, "intermediate_size": 44, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 56, "num_hidden_layers": 2, "max_position_embeddings": 16}
DIMS = {SMALL_SEQ: BIG_SEQ, SMALL_SEQ - 1: BIG_SEQ - 1, BATCH * SMALL_SEQ: BATCH * BIG_SEQ,
        BATCH * (SMALL_SEQ - 1): BATCH * (BIG_SEQ - 1), 4: 32, 6: 128, 3: 64, 24: 4096, 44: 11008, 56: 32000}
"""Small dimension -> the 7B model's (all small values distinct; 1 and the batch stay)."""


def mpress(args: list[str], cwd) -> None:
    start = time.perf_counter()
    code, out, err = run_documented(args, cwd=cwd, in_process=True)
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    print(f"mpress {' '.join(args)}: {time.perf_counter() - start:.1f} s")


def test_llama_2_7b_profiled_and_planned_with_saved_bytes_of_a_small_run_scaled(tmp_path):
    mpress(["profile", "--hf-config", "llama-2-7b", "--seq-len", str(BIG_SEQ), "--microbatch-size", str(BATCH),
            "--fake", "--hardware", "dgx-a100", "--out", "7b.yaml"], tmp_path)
    mpress(["plan", "--profile", "7b.yaml", "--hardware", "dgx-a100", "--num-microbatches", "16",
            "--out", "plan.yaml"], tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    big = Profile.load(tmp_path / "7b.yaml")
    assert plan["model"] == big.model == "hf:llama-2-7b" and plan["num_stages"] == 8

    config = json.loads((HF_CONFIG_DIR / "llama-2-7b.json").read_text())
    (tmp_path / "small.json").write_text(json.dumps({**config, **SMALL}))
    small = profile_hf_model(str(tmp_path / "small.json"), microbatch_size=BATCH, seq_len=SMALL_SEQ,
                             hardware=load_hardware("cpu-local"), fake=False, warmup=0, iters=1)
    assert small.source == "measured" and big.source == "fake"

    layers = {x.name: x for x in small.layers}
    assert [x.name for x in big.layers] == ["embed", *(f"blocks.{i}" for i in range(32)), "head"]
    total = 0
    for layer in big.layers:
        like = layers["blocks.0" if layer.name.startswith("blocks.") else layer.name]
        rng = [b for b in layer.saved if b.dtype in ("uint64", "int64") and b.shape in ([], [2])
               and b.op.startswith("aten._scaled_dot_product_")]  # the GPU's attention kernel's alone
        assert sum(b.bytes for b in rng) in ((24, 16) if layer.name.startswith("blocks.") else (0,)), layer.name
        total += sum(b.bytes for b in rng)
        saved = [b for b in layer.saved if b not in rng]
        assert len(like.saved) == len(saved), layer.name
        for s, b in zip(like.saved, saved):
            assert s.id.replace("blocks.0.", f"{layer.name}.") == b.id and s.dtype == b.dtype
            assert [DIMS.get(d, d) for d in s.shape] == b.shape, (b.id, s.shape, b.shape)
            scaled = s.bytes * math.prod(b.shape) // max(1, math.prod(s.shape))
            assert scaled == b.bytes, (b.id, s.bytes, b.bytes)
            total += scaled
    assert total == sum(x.saved_bytes for x in big.layers) > 0
    print(f"llama-2-7b at {BATCH} x {BIG_SEQ} tokens: {total / 1e9:.2f} GB saved per microbatch")
