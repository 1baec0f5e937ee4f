"""Analytic and measured profilers, the `Profile` file format and `mpress profile`."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mpress.cli import main
from mpress.errors import ProfileError, UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.models.transformer import (
    build_model,
    build_stage,
    example_batch,
    lm_loss,
    num_parameters,
)
from mpress.models.user_module import load_user_factory
from mpress.static.profile.analytic import analytic_profile, layer_saved_tensors
from mpress.static.profile.measured import measure_model_profile, measure_profile
from mpress.static.profile.profile import Profile
from tests.support.user_model import TiedSquare


def _cfg(name: str, **changes):
    return dataclasses.replace(load_model_config(name), **changes)


def _key(t):
    return (t.module, t.index, t.bytes, t.shape)


def _assert_same_saved(analytic: Profile, measured: Profile, with_dtype: bool = True) -> None:
    assert analytic.layer_names() == measured.layer_names()
    for a, m in zip(analytic.layers, measured.layers):
        ka = [_key(t) + ((t.dtype,) if with_dtype else ()) for t in a.saved]
        km = [_key(t) + ((t.dtype,) if with_dtype else ()) for t in m.saved]
        assert ka == km, a.name


CPU = load_hardware("cpu-local")


# -- the key validation: analytic == measured ---------------------------------------------

@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
@pytest.mark.parametrize("batch", [1, 3])
def test_analytic_saved_tensors_equal_measured(name, batch):
    cfg = load_model_config(name)
    measured = measure_model_profile(cfg, batch, warmup=0, iters=1)
    analytic = analytic_profile(cfg, CPU, batch)
    _assert_same_saved(analytic, measured)
    for a, m in zip(analytic.layers, measured.layers):
        assert a.forward_flops == m.forward_flops and a.backward_flops == m.backward_flops, a.name
        assert a.output_bytes == m.output_bytes, a.name
        assert (a.param_bytes, a.grad_bytes, a.optim_bytes, a.master_bytes) == \
            (m.param_bytes, m.grad_bytes, m.optim_bytes, m.master_bytes), a.name
    assert measured.layer_names() == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


@pytest.mark.parametrize("changes", [{"dropout": 0.0}, {"num_heads": 1, "ffn_hidden_size": 48, "num_layers": 1}])
def test_analytic_equals_measured_for_variants(changes):
    for name in ["gpt-tiny", "bert-tiny"]:
        cfg = _cfg(name, **changes)
        _assert_same_saved(analytic_profile(cfg, CPU, 2), measure_model_profile(cfg, 2, warmup=0, iters=1))


def test_no_dropout_saves_no_mask():
    prof = analytic_profile(_cfg("gpt-tiny", dropout=0.0), CPU, 2)
    assert not any(t.dtype == "bool" for layer in prof.layers for t in layer.saved)


def test_mixed_precision_matches_except_layernorm_stats():
    # CUDA keeps LayerNorm mean/rstd in fp32 (what the analytic profile models); the CPU
    # kernel keeps them in the half dtype. Everything else must agree.
    cfg = _cfg("gpt-tiny", precision="bf16")
    analytic = analytic_profile(cfg, CPU, 2)
    measured = measure_model_profile(cfg, 2, warmup=0, iters=1)
    assert measured.dtype == analytic.dtype == "bf16"
    for a, m in zip(analytic.layers, measured.layers):
        assert len(a.saved) == len(m.saved)
        for ta, tm in zip(a.saved, m.saved):
            assert (ta.module, ta.index, ta.shape) == (tm.module, tm.index, tm.shape)
            if ta.what.endswith(("mean", "rstd")):
                assert (ta.dtype, tm.dtype) == ("float32", "bfloat16")
            else:
                assert (ta.dtype, ta.bytes) == (tm.dtype, tm.bytes), ta.id


def test_measured_flops_agree_with_flop_counter_on_whole_step():
    cfg = load_model_config("bert-tiny")
    model = build_model(cfg, seed=0)
    ids, targets = example_batch(cfg, 2)
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(ids), targets).backward()
    prof = analytic_profile(cfg, CPU, 2)
    total = sum(x.forward_flops + x.backward_flops for x in prof.layers)
    assert total == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_block_flops_by_hand():
    # Block forward: 2*B*T*(3h^2 + h^2 + 2*h*f) for the projections + 2 * 2*B*T^2*h for the
    # two attention products. gpt-tiny, B=2: 2*64*(12288+4096+32768) + 4*2*1024*64.
    prof = analytic_profile(load_model_config("gpt-tiny"), CPU, 2)
    assert prof.layers[1].forward_flops == 6_815_744
    assert prof.layers[1].backward_flops == 2 * 6_815_744
    assert prof.layers[0].forward_flops == 0
    assert prof.layers[-1].forward_flops == 2 * 64 * 64 * 256  # B*T x h x V head projection


def test_measured_stage_profiles_match_analytic_layers():
    cfg = load_model_config("gpt-tiny")
    stage = build_stage(cfg, 2, 4, seed=0)  # layers.1, layers.2
    hidden = torch.randn(2, cfg.seq_len, cfg.hidden_size, requires_grad=True)
    prof = measure_profile(stage, hidden, model_name=cfg.name, fingerprint=cfg.fingerprint(),
                           microbatch_size=2, warmup=0, iters=1)
    assert prof.layer_names() == ["layers.1", "layers.2"]
    for i, layer in zip([2, 3], prof.layers):
        assert [_key(t) for t in layer.saved] == [_key(t) for t in layer_saved_tensors(cfg, i, 2)]


# -- analytic profile at scale -------------------------------------------------------------

def test_analytic_25b_block_activations_match_the_literature():
    # (its speed is measured where speed belongs: bench/plan_speed.py)
    cfg = load_model_config("gpt-25.5b")
    hw = load_hardware("dgx1-v100")
    prof = analytic_profile(cfg, hw, 2)
    assert prof.source == "analytic" and prof.device == hw.name and prof.dtype == "fp16"
    # Korthikanti et al. 2022 (activation memory of a transformer layer, 16-bit, with
    # dropout): s*b*h*(34 + 5*a*s/h) bytes; plus LayerNorm mean/rstd in fp32: 2 LNs x 2 x s*b x 4.
    s, b, h, a = cfg.seq_len, 2, cfg.hidden_size, cfg.num_heads
    expected = s * b * h * (34 + 5 * a * s / h) + 16 * s * b
    assert prof.layers[1].saved_bytes == expected
    # Model state: fp16 params + grads, fp32 Adam (8 B) and master weights (4 B) per parameter.
    n = num_parameters(cfg)
    assert sum(x.param_bytes for x in prof.layers) == 2 * n
    assert sum(x.model_state_bytes for x in prof.layers) == 16 * n
    assert prof.layers[1].output_bytes == s * b * h * 2 and prof.layers[-1].output_bytes == 4


def test_analytic_times_from_peak_and_efficiency():
    cfg = load_model_config("bert-1.67b")
    hw = load_hardware("dgx-a100")
    prof = analytic_profile(cfg, hw, 4)
    rate = hw.peak_flops("fp16") * hw.compute_efficiency
    for layer in prof.layers:
        assert layer.forward_time_s == pytest.approx(layer.forward_flops / rate)
        assert layer.backward_time_s == pytest.approx(2 * layer.forward_time_s)


def test_analytic_fp32_has_no_master_weights():
    prof = analytic_profile(load_model_config("gpt-tiny"), CPU, 1)
    assert all(x.master_bytes == 0 and x.optim_bytes == 2 * x.param_bytes for x in prof.layers)


# -- measured profiler on user modules -------------------------------------------------------

class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.ReLU()
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(x + self.a(x))


def _measure(module, x):
    return measure_profile(module, x, model_name="m", fingerprint="f", microbatch_size=x.shape[0],
                           warmup=0, iters=1)


def test_layers_of_user_modules():
    x = torch.randn(3, 8)
    assert _measure(nn.Sequential(nn.Linear(8, 8), nn.GELU()), x).layer_names() == ["0", "1"]
    assert _measure(_Chain(), x).layer_names() == ["a", "b", "c"]
    assert _measure(_Residual(), x).layer_names() == [""]


def test_measured_user_module_saved_tensors():
    x = torch.randn(3, 8)
    prof = _measure(_Chain(), x)
    a, b, c = prof.layers
    assert [(t.id, t.bytes, t.shape) for t in a.saved] == [("a#0", 3 * 8 * 4, [3, 8])]  # Linear input
    assert [(t.id, t.dtype) for t in b.saved] == [("b#0", "float32")]  # ReLU saves its output
    assert c.saved[0].id == "c#0" and c.saved[0].bytes == 3 * 16 * 4
    assert a.param_bytes == (8 * 16 + 16) * 4 and a.optim_bytes == 2 * a.param_bytes
    assert a.output_bytes == 3 * 16 * 4
    assert a.forward_flops == 2 * 3 * 8 * 16 and c.backward_flops == 2 * c.forward_flops


def test_parameters_skipped_and_shared_storage_counted_once():
    prof = _measure(TiedSquare(), torch.randn(3, 8, requires_grad=True))
    saved = prof.layers[0].saved
    # x * x saves x twice (the second shares storage: 0 bytes); the matmul saves x*x but
    # not the transposed weight, which shares the parameter's storage.
    assert [(t.id, t.bytes) for t in saved] == [("#0", 96), ("#1", 0), ("#2", 96)]


# -- user factories -----------------------------------------------------------------------

@pytest.fixture()
def user_pkg(tmp_path, monkeypatch):
    (tmp_path / "mp_user_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def good():
            return nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4)

        def with_loss():
            return nn.Linear(4, 3), torch.randn(5, 4), lambda out: out.pow(2).mean()

        def wrong():
            return 42

        def broken():
            raise RuntimeError("boom")

        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mp_user_models"


def test_load_user_factory(user_pkg):
    user = load_user_factory(f"{user_pkg}:good")
    assert isinstance(user.module, nn.Sequential) and user.loss_fn is None
    assert load_user_factory(f"{user_pkg}:with_loss").loss_fn is not None


@pytest.mark.parametrize("attr,match", [("wrong", "must return"), ("broken", "boom"),
                                        ("not_callable", "no callable"), ("missing", "no callable")])
def test_bad_user_factories(user_pkg, attr, match):
    with pytest.raises(UserError, match=match):
        load_user_factory(f"{user_pkg}:{attr}")


@pytest.mark.parametrize("spec", ["nocolon", ":f", "mod:", "no_such_module_xyz:f"])
def test_bad_factory_specs(spec):
    with pytest.raises(UserError):
        load_user_factory(spec)


# -- Profile file format ----------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    prof = measure_model_profile(load_model_config("bert-tiny"), 2, warmup=0, iters=1)
    path = tmp_path / f"p{suffix}"
    prof.save(path)
    assert Profile.load(path) == prof


def test_profile_for_another_model_is_refused(tmp_path):
    prof = analytic_profile(load_model_config("gpt-tiny"), CPU, 1)
    prof.save(tmp_path / "p.yaml")
    loaded = Profile.load(tmp_path / "p.yaml")
    loaded.check_model(load_model_config("gpt-tiny"))
    with pytest.raises(ProfileError, match="gpt-tiny"):
        loaded.check_model(load_model_config("bert-tiny"))


# -- mpress profile ----------------------------------------------------------------------

def test_cli_measured_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "gpt-tiny", "--microbatch-size", "2", "--warmup", "0",
                 "--iters", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layers.3" in text and "total" in text and "saved MB" in text
    prof = Profile.load(out)
    assert prof.source == "measured" and prof.microbatch_size == 2 and prof.num_layers == 6


def test_cli_analytic_profile(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    assert main(["profile", "--model", "gpt-25.5b", "--analytic", "--hardware", "dgx1-v100",
                 "--out", str(out)]) == 0
    last = load_model_config("gpt-25.5b").num_layers - 1
    assert f"layers.{last}" in capsys.readouterr().out
    prof = Profile.load(out)
    assert prof.device == "dgx1-v100" and prof.layer_names()[-2] == f"layers.{last}"


def test_cli_user_module(user_pkg, capsys):
    assert main(["profile", "--module", f"{user_pkg}:good", "--warmup", "0", "--iters", "1"]) == 0
    assert "microbatch 2" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--model", "no-such-model"],
    ["--model", "gpt-tiny", "--analytic"],
    ["--model", "gpt-tiny", "--analytic", "--fake", "--hardware", "cpu-local"],
    ["--model", "gpt-tiny", "--layers", "layers.*"],
    ["--module", "mp_user_models:good", "--analytic", "--hardware", "cpu-local"],
    ["--module", "nocolon"],
    ["--model", "gpt-tiny", "--out", "p.txt"],
    ["--model", "gpt-tiny", "--microbatch-size", "0"],
    ["--model", "gpt-tiny", "--iters", "0"],
    ["--module", "mp_user_models:good", "--microbatch-size", "3"],
    [],
])
def test_cli_bad_input_is_one_line(user_pkg, capsys, argv):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and "Traceback" not in err


# -- CUDA ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_analytic_equals_measured_on_cuda(precision):
    cfg = _cfg("gpt-tiny", precision=precision)
    measured = measure_model_profile(cfg, 2, "cuda", warmup=1, iters=1)
    _assert_same_saved(analytic_profile(cfg, CPU, 2), measured)
    assert measured.peak_memory_bytes > 0
