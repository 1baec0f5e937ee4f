"""An HF model's `dtype` in its profiles (issue 28): a bf16 model's fake profile saves the
same tensors as the fp32 one, each half-precision one in half the bytes, counted exactly
(what transformers upcasts to fp32 -- RMSNorm's variance, the loss's logits -- stays 4
bytes an element); the measured profile saves what the fake one finds; the profile and
the plan made from it record bf16."""

from __future__ import annotations

import pytest
import torch

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.models.hf_config import resolve_hf
from mpress.models.hf_model import load_hf_model
from mpress.static.profile.fake_profile import profile_hf_model

pytest.importorskip("transformers")

CPU = load_hardware("cpu-local")
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}


def _profile(dtype: str, *, fake: bool = True):
    return profile_hf_model("llama-tiny", microbatch_size=2, hardware=CPU, fake=fake, dtype=dtype, warmup=0, iters=1)


def test_bf16_fake_profile_saves_half_the_bytes_counted_exactly():
    fp32, bf16 = _profile("fp32"), _profile("bf16")
    assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16")
    for a, b in zip(fp32.layers, bf16.layers, strict=True):
        assert [(x.module, x.shape) for x in a.saved] == [(x.module, x.shape) for x in b.saved], a.name
        for x, y in zip(a.saved, b.saved):
            numel = 1
            for n in y.shape:
                numel *= n
            assert y.bytes in (0, numel * ITEM_BYTES[y.dtype]), (a.name, y)  # 0: a view of one counted already
            # a float the fp32 model saves is bf16 here, or fp32 where transformers upcasts
            assert x.dtype == y.dtype or (x.dtype, y.dtype) == ("float32", "bfloat16"), (a.name, x, y)
            assert y.bytes == (x.bytes // 2 if y.dtype == "bfloat16" else x.bytes)
        assert b.param_bytes * 2 == a.param_bytes
        assert b.model_state_bytes == a.model_state_bytes  # bf16 params + grads + fp32 masters = fp32's
    saved32 = sum(x.saved_bytes for x in fp32.layers)
    saved16 = sum(x.saved_bytes for x in bf16.layers)
    halved = sum(y.bytes for layer in bf16.layers for y in layer.saved if y.dtype == "bfloat16")
    assert saved16 == saved32 - halved  # exactly: every bf16 tensor is half its fp32 twin
    assert 0.5 < saved16 / saved32 < 0.65  # about half: upcasts and int64 ids stay


def test_bf16_measured_profile_saves_what_the_fake_one_finds():
    fake, measured = _profile("bf16"), _profile("bf16", fake=False)
    assert measured.source == "measured" and measured.dtype == "bf16"
    assert [x.saved_bytes for x in measured.layers] == [x.saved_bytes for x in fake.layers]


def test_the_model_is_built_in_its_dtype():
    model = load_hf_model("llama-tiny", microbatch_size=1, dtype="bf16")
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
    assert model.precision == "bf16"
    assert model.fingerprint() != load_hf_model("llama-tiny", microbatch_size=1).fingerprint()
    half = load_hf_model("llama-tiny", microbatch_size=1, dtype="fp16")
    assert {p.dtype for p in half.module.parameters()} == {torch.float16} and half.precision == "fp16"
    with pytest.raises(UserError, match="dtype 'fp8'"):
        resolve_hf("llama-tiny", dtype="fp8")
