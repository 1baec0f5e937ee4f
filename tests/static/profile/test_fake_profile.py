"""The fake-tensor profiler: a module built on meta, run on fake tensors, gives the saved
tensors, FLOPs and memory of a real run, at any size, with times from the hardware model."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.models.user_module import module_fingerprint, select_layers
from mpress.static.profile.analytic import analytic_profile, flops_time_s
from mpress.static.profile.fake_profile import fake_model_profile, fake_profile
from mpress.static.profile.measured import measure_profile
from tests.support import user_model
from tests.support.user_model import TiedSquare

CPU = load_hardware("cpu-local")
LAYERS = user_model.LAYERS.split(",")


def _saved(layer, rename: str | None = None):
    """A layer's saved tensors as comparable tuples (`rename` replaces the layer's path).

    `held` is left out for host scalars: a real run's `LiveBytes` does not see
    `torch.tensor(0.5)` being made (it is lifted into the dispatcher already made) and
    calls the scalar held; on fake tensors its lifting makes a fake one, and it is not."""
    def mod(m: str) -> str:
        return m.replace(layer.name, rename, 1) if rename is not None else m
    return [(mod(t.module), t.index, t.bytes, t.shape, t.dtype, t.input, t.held if t.shape else None, t.what)
            for t in layer.saved]


def _assert_same_memory(f, r) -> None:
    """Fake layer `f` holds what real layer `r` holds; the memory probe counts the host
    scalar on fake tensors only (see `_saved`)."""
    scalar_bytes = sum(t.bytes for t in f.saved if not t.shape)
    for mf, mr in [(f.memory, r.memory), (f.recompute_memory, r.recompute_memory)]:
        for key in ("kept_bytes", "forward_peak_bytes", "backward_peak_bytes"):
            assert abs(getattr(mf, key) - getattr(mr, key)) <= scalar_bytes, (r.name, key)
        assert (mf.saves_input, mf.saves_output, mf.input_grad_bytes, mf.output_bytes, mf.loss_bytes) == \
            (mr.saves_input, mr.saves_output, mr.input_grad_bytes, mr.output_bytes, mr.loss_bytes), r.name


def _real(make, **kw):
    module, x, loss = make(**kw)
    return measure_profile(module, x, model_name="user", fingerprint=module_fingerprint(module), microbatch_size=x.shape[0],
                           loss_fn=loss, warmup=0, iters=1, layers=LAYERS)


def _fake(make, **kw):
    return fake_profile(functools.partial(make, **kw), model_name="user", hardware=CPU, layers=LAYERS)


def test_fake_profile_equals_a_real_run_of_a_residual_module_with_a_cpu_scalar():
    real, fake = _real(user_model.make), _fake(user_model.make)
    assert fake.source == "fake" and real.source == "measured"
    assert fake.layer_names() == real.layer_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert fake.model_fingerprint == real.model_fingerprint  # the structure, not the values
    for r, f in zip(real.layers, fake.layers):
        assert _saved(f) == _saved(r), r.name
        assert (f.forward_flops, f.backward_flops) == (r.forward_flops, r.backward_flops), r.name
        assert (f.output_bytes, f.param_bytes, f.optim_bytes, f.param_tensors) == \
            (r.output_bytes, r.param_bytes, r.optim_bytes, r.param_tensors), r.name
        _assert_same_memory(f, r)
    # the host scalar the attention output is scaled by is saved, and counted
    scalars = [t for t in fake.layers[1].saved if t.shape == []]
    assert len(scalars) == 1 and scalars[0].bytes == 4 and not scalars[0].held


def test_fake_times_come_from_the_hardware_model():
    prof = _fake(user_model.make)
    for layer in prof.layers:
        assert layer.forward_time_s == flops_time_s(layer.forward_flops, CPU, prof.dtype)
        assert layer.backward_time_s == flops_time_s(layer.backward_flops, CPU, prof.dtype)
        assert layer.forward_time_iqr_s == 0 and layer.backward_time_iqr_s == 0
    assert prof.device == CPU.name and prof.time_samples == 0
    assert sum(layer.forward_flops for layer in prof.layers) > 0


def test_a_10b_parameter_model_is_profiled_without_its_memory():
    fake = fake_profile(user_model.make_10b, model_name="10b", hardware=CPU, layers=LAYERS)
    params = sum(layer.param_bytes for layer in fake.layers) // 4
    assert params > 10e9
    real = _real(user_model.make, vocab=1024, hidden=4096, heads=32, num_blocks=1, batch=2, seq=32)
    block = real.layers[1]
    assert block.name == "blocks.0" and block.saved_bytes > 0
    assert _saved(fake.layers[1]) == _saved(block)
    for layer in fake.layers[1:-1]:  # every one of the 50 blocks saves what the real block saves
        # (its input is the block before's output, the first block's the embedding's)
        assert [t[:-1] for t in _saved(layer, rename="blocks.0")] == [t[:-1] for t in _saved(block)], layer.name
        assert (layer.forward_flops, layer.backward_flops) == (block.forward_flops, block.backward_flops)
        _assert_same_memory(layer, block)
    assert _saved(fake.layers[0]) == _saved(real.layers[0])


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-20.4b"])
def test_gpt_presets_fake_profile_equals_the_analytic_one(name):
    cfg = load_model_config(name)
    hw = load_hardware("dgx1-v100")
    fake, analytic = fake_model_profile(cfg, 2, hw), analytic_profile(cfg, hw, 2)
    assert fake.layer_names() == analytic.layer_names() and fake.model_fingerprint == cfg.fingerprint()
    saved_f = sum(x.saved_bytes for x in fake.layers)
    saved_a = sum(x.saved_bytes for x in analytic.layers)
    assert abs(saved_f - saved_a) <= 1e-3 * saved_a
    for f, a in zip(fake.layers, analytic.layers):
        assert abs(f.saved_bytes - a.saved_bytes) <= 1e-3 * a.saved_bytes, a.name
        assert [t.id for t in f.saved] == [t.id for t in a.saved], a.name
        # the analytic FLOPs count matrix products, as FlopCounterMode does
        assert (f.forward_flops, f.backward_flops) == (a.forward_flops, a.backward_flops), a.name
        assert f.forward_time_s == a.forward_time_s, a.name
        assert (f.param_bytes, f.optim_bytes, f.master_bytes) == (a.param_bytes, a.optim_bytes, a.master_bytes)


def test_storage_identity_under_fake_tensors():
    # every fake storage's data_ptr is 0: identity by data_ptr would take x for a
    # parameter (naming nothing) or count x * x's second x again
    prof = fake_profile(lambda: (TiedSquare(), torch.randn(3, 8, requires_grad=True)), model_name="t",
                        hardware=CPU)
    assert [(t.id, t.bytes) for t in prof.layers[0].saved] == [("#0", 96), ("#1", 0), ("#2", 96)]


def test_select_layers_by_name_patterns():
    module = user_model.make()[0]
    assert select_layers(module, ["embed", "blocks.*", "head"]) == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert select_layers(module, ["blocks.1", "blocks.2"]) == ["blocks.1", "blocks.2"]
    with pytest.raises(UserError, match="names no module"):
        select_layers(module, ["embed", "towers.*"])
    with pytest.raises(UserError, match="inside"):
        select_layers(module, ["blocks.*", "blocks.0.fc1"])


def test_a_module_that_needs_data_is_one_line():
    class NeedsValues(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()

    with pytest.raises(UserError, match="fake tensors"):
        fake_profile(lambda: (NeedsValues(), torch.randn(4)), model_name="v", hardware=CPU)
