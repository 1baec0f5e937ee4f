"""The Llama family's analytic profile (`mpress/static/profile/analytic_llama.py`) against
measurement: fake tensors (the tiny preset's variants, and one real-size layer), a real
CPU run, and the flop counter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.models.transformer import TORCH_DTYPES, build_model, build_stage, example_batch, lm_loss
from mpress.static.profile.analytic import analytic_profile, layer_saved_tensors
from mpress.static.profile.analytic_llama import gpu_kernel
from mpress.static.profile.fake_profile import fake_model_profile, fake_profile
from mpress.contract.flop_formulas import EXTRA_FLOP_FORMULAS
from mpress.static.profile.measured import measure_model_profile, storage_id
from mpress.static.profile.sdpa_choice import compute_capability

CPU = load_hardware("cpu-local")
H100 = load_hardware("hgx-h100")

VARIANTS = [
    {},  # eager, fp32, 2 kv heads for 4 query heads
    {"precision": "bf16"},
    {"attention": "sdpa"},
    {"attention": "sdpa", "precision": "bf16", "num_kv_heads": 1},
    {"attention": "sdpa", "num_kv_heads": 4, "precision": "fp16"},
    {"dropout": 0.1, "num_kv_heads": 4},
    {"dropout": 0.1, "precision": "bf16", "num_heads": 1, "num_kv_heads": 1, "ffn_hidden_size": 40},
]


def _cfg(name: str = "llama-tiny", **changes):
    return dataclasses.replace(load_model_config(name), **changes)


def _saved(layer_saved):
    """Comparable saved tensors. `held` is left out for the loss's targets: the analytic
    profile calls them held (a view of the iteration's targets), a fake run does not see
    who holds them (as for GPT)."""
    return [(t.id, t.shape, t.dtype, t.bytes, t.input, t.held if not t.module == "head" else None)
            for t in layer_saved]


@pytest.mark.parametrize("changes", VARIANTS)
def test_analytic_profile_equals_the_fake_one(changes):
    cfg = _cfg(**changes)
    fake, analytic = fake_model_profile(cfg, 2, CPU), analytic_profile(cfg, CPU, 2)
    assert fake.layer_names() == analytic.layer_names() and fake.model_fingerprint == cfg.fingerprint()
    for f, a in zip(fake.layers, analytic.layers):
        assert _saved(f.saved) == _saved(a.saved), a.name
        # the profilers count the CPU SDPA kernel with torch's own formulas (flop_formulas)
        assert (f.forward_flops, f.backward_flops) == (a.forward_flops, a.backward_flops), a.name
        assert (f.param_bytes, f.optim_bytes, f.master_bytes, f.param_tensors, f.output_bytes) == \
            (a.param_bytes, a.optim_bytes, a.master_bytes, a.param_tensors, a.output_bytes), a.name
        if a.name != "head":  # the head's loss holds the targets in a fake run only (see _saved)
            assert (f.memory, f.recompute_memory) == (a.memory, a.recompute_memory), a.name


V100 = load_hardware("dgx1-v100")

GPU_VARIANTS = [
    (H100, {"attention": "sdpa", "precision": "bf16", "num_kv_heads": 1}, "flash"),
    (H100, {"attention": "sdpa", "precision": "fp16", "num_kv_heads": 4, "seq_len": 100}, "flash"),
    (H100, {"attention": "sdpa", "num_kv_heads": 4, "seq_len": 100}, "efficient"),  # fp32: lse padded to 128
    (V100, {"attention": "sdpa", "precision": "fp16", "num_kv_heads": 4}, "efficient"),  # no flash before sm80
]


@pytest.mark.parametrize("hardware, changes, kernel", GPU_VARIANTS)
def test_a_gpu_targets_analytic_profile_equals_its_fake_one(hardware, changes, kernel):
    """On a GPU the fake profile runs CUDA's fused SDPA kernel (`cuda_kernels`): the
    analytic profile lists what it saves (its padded log-sum-exp, its RNG state), and its
    memory probe runs it, so saved tensors, memory and recompute choices are the fake's."""
    cfg = _cfg(**changes)
    assert gpu_kernel(cfg, hardware) == (compute_capability(hardware), kernel)
    fake, analytic = fake_model_profile(cfg, 2, hardware), analytic_profile(cfg, hardware, 2)
    for f, a in zip(fake.layers, analytic.layers):
        assert _saved(f.saved) == _saved(a.saved), a.name
        assert (f.forward_flops, f.backward_flops) == (a.forward_flops, a.backward_flops), a.name
        if a.name != "head":  # the head's loss holds the targets in a fake run only (see _saved)
            assert (f.memory, f.recompute_memory) == (a.memory, a.recompute_memory), a.name
            assert f.recompute_options == a.recompute_options, a.name
    block = analytic.layers[1].saved
    lse = next(t for t in block if t.what == "SDPA log-sum-exp")
    assert lse.shape[-1] == (-(-cfg.seq_len // 32) * 32 if kernel == "efficient" else cfg.seq_len)
    rng = [(t.shape, t.dtype) for t in block if t.what.startswith(f"CUDA {kernel} kernel's random-generator")]
    assert rng == ([([2], "uint64"), ([], "uint64")] if kernel == "flash" else [([], "int64"), ([], "int64")])


def test_the_math_path_on_a_gpu_is_listed_as_the_cpu_kernel_saves():
    """fp32 with grouped-query heads runs SDPA's math path on a GPU: not modelled (see the
    module docstring), listed as on the CPU."""
    cfg = _cfg(attention="sdpa")
    assert cfg.kv_heads < cfg.num_heads and gpu_kernel(cfg, H100) is None
    assert _saved(layer_saved_tensors(cfg, 1, 2, H100)) == _saved(layer_saved_tensors(cfg, 1, 2, CPU))


def test_attention_kinds_save_what_they_should():
    eager, sdpa = (analytic_profile(_cfg(attention=a, precision="bf16"), CPU, 2).layers[1] for a in ("eager", "sdpa"))
    b, nh, t = 2, 4, 32
    # eager keeps the (B, nh, T, T) probabilities, fp32 and bf16; SDPA its (B, nh, T) log-sum-exp
    assert [x.shape for x in eager.saved if x.shape[-2:] == [t, t]] == [[b, nh, t, t], [b * nh, t, t]]
    assert [x.dtype for x in eager.saved if x.shape[-2:] == [t, t]] == ["float32", "bfloat16"]
    assert not any(x.shape[-2:] == [t, t] for x in sdpa.saved)
    assert [x.shape for x in sdpa.saved if x.dtype == "float32" and x.shape[-1] == t] == [[b, nh, t]]
    assert sdpa.saved_bytes < eager.saved_bytes


@pytest.mark.parametrize("changes", [{}, {"attention": "sdpa"}])
def test_analytic_saved_tensors_equal_a_real_cpu_run(changes):
    cfg = _cfg(**changes)
    measured, analytic = measure_model_profile(cfg, 3, warmup=0, iters=1), analytic_profile(cfg, CPU, 3)
    for m, a in zip(measured.layers, analytic.layers):
        assert [(t.id, t.shape, t.dtype, t.bytes) for t in m.saved] == \
            [(t.id, t.shape, t.dtype, t.bytes) for t in a.saved], a.name


def test_the_cpu_sdpa_kernel_is_counted_with_torchs_own_formulas():
    cfg = _cfg(attention="sdpa", num_kv_heads=2)
    b, nh, kv, t, hd = 3, cfg.num_heads, cfg.kv_heads, cfg.seq_len, cfg.head_dim
    q = torch.randn(b, nh, t, hd, requires_grad=True)
    k, v = (torch.randn(b, kv, t, hd, requires_grad=True) for _ in range(2))
    counts = []
    for mapping in ({}, EXTRA_FLOP_FORMULAS):
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            forward = counter.get_total_flops()
            out.sum().backward()
        counts.append((forward, counter.get_total_flops() - forward))
    assert counts[0] == (0, 0)  # torch alone does not count the CPU kernel
    # torch's formulas over the key/value heads broadcast to the query's (what the kernel
    # computes; torch <= 2.11's formulas refuse fewer key/value heads than query heads)
    kq = vq = (b, nh, t, hd)
    assert counts[1] == (sdpa_flop_count(q.shape, kq, vq), sdpa_backward_flop_count(q.shape, q.shape, kq, vq))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_analytic_flops_are_what_the_flop_counter_counts_on_a_real_step(attention):
    cfg = _cfg(attention=attention)
    model = build_model(cfg, seed=0)
    ids, targets = example_batch(cfg, 2)
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        lm_loss(model(ids), targets).backward()
    prof = analytic_profile(cfg, CPU, 2)
    assert counter.get_total_flops() == sum(x.forward_flops + x.backward_flops for x in prof.layers)


@pytest.mark.parametrize("name, changes", [("llama-3-70b", {}), ("llama-2-7b", {"attention": "eager"})])
def test_a_real_size_layer_under_fake_tensors_equals_the_analytic_one(name, changes):
    cfg = _cfg(name, **changes)

    def factory():
        x = torch.zeros(1, cfg.seq_len, cfg.hidden_size, dtype=TORCH_DTYPES[cfg.precision], requires_grad=True)
        return build_stage(cfg, 1, 3, seed=0, device="meta"), x  # layers.0 and layers.1: the loss is after layers.1

    fake = fake_profile(factory, model_name=name, hardware=H100, layers=["layers.0", "layers.1"]).layers[0]
    analytic = analytic_profile(cfg, H100, 1).layers[1]
    # grouped-query SDPA runs CUDA flash on an H100 (`cuda_kernels`, `sdpa_choice`), which
    # also keeps its RNG state (24 B): the analytic layer lists it, and its memory probe
    # runs that kernel, so its memory and recompute choices are the fake run's
    rng = [(t.shape, t.dtype, t.bytes) for t in analytic.saved if t.dtype == "uint64"]
    assert rng == ([([2], "uint64", 16), ([], "uint64", 8)] if cfg.attention == "sdpa" else [])
    assert _saved(fake.saved) == _saved(analytic.saved) == _saved(layer_saved_tensors(cfg, 1, 1, H100))
    assert fake.saved_bytes == analytic.saved_bytes
    producers = [[(t.op, t.op_flops, t.op_bytes) for t in x.saved] for x in (fake, analytic)]
    assert producers[0] == producers[1]
    assert (fake.forward_flops, fake.backward_flops) == (analytic.forward_flops, analytic.backward_flops)
    assert (fake.memory, fake.recompute_memory) == (analytic.memory, analytic.recompute_memory)
    assert fake.recompute_options == analytic.recompute_options and analytic.recompute_options
    assert fake.param_bytes == analytic.param_bytes
    # the CPU's flash kernel keeps no RNG state
    on_cpu = layer_saved_tensors(cfg, 1, 1, CPU)
    assert _saved(on_cpu) == _saved(layer_saved_tensors(cfg, 1, 1)) == _saved(t for t in analytic.saved
                                                                              if t.dtype != "uint64")


def test_op_level_recompute_prices_sdpa_with_its_flops():
    """SDPA's saved output costs its products to re-make (not only the bytes it moves):
    the op-level recompute must not take it for a cheap elementwise operator."""
    cfg = _cfg("llama-3-8b")
    layer = analytic_profile(cfg, H100, 1).layers[1]
    q = [1, cfg.num_heads, cfg.seq_len, cfg.head_dim]  # key/value heads broadcast to the query's, as computed
    sdpa = [t for t in layer.saved if "scaled_dot_product" in (t.op or "")]
    assert cfg.kv_heads < cfg.num_heads and sdpa and all(t.op_flops == sdpa_flop_count(q, q, q) for t in sdpa)


cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                reason="fake CUDA tensors need a CUDA build of torch (no GPU needed)")


class _CudaFlash(TorchFunctionMode):
    """SDPA as an H100 runs it: CUDA's flash kernel (fake CUDA tensors cannot ask the
    device which kernel it runs, and would take the math path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        assert kwargs.get("enable_gqa", False) == (k.size(1) != q.size(1))
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, kwargs.get("is_causal", False))[0]


@cuda_build
@pytest.mark.parametrize("changes", [{"attention": "sdpa", "precision": "bf16", "num_kv_heads": 1},
                                     {"attention": "sdpa", "precision": "fp16", "num_kv_heads": 4}])
def test_a_blocks_analytic_saves_are_what_fake_cuda_tensors_save(changes):
    """A block's forward on fake CUDA tensors (a CUDA build of torch: torch's own CUDA
    flash kernel, whose RNG seed and offset it saves) saves what the analytic profile of
    an H100 lists: the same tensors in the same order, and as many bytes (its parameters
    apart, which the profile never lists)."""
    cfg, b = _cfg(**changes), 2
    assert gpu_kernel(cfg, H100) == (compute_capability(H100), "flash")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    layer = build_stage(cfg, 1, 2, device="meta").train()
    for sub in layer.modules():  # its parameters as fake CUDA tensors
        for name, p in [(n, p) for n, p in sub._parameters.items() if p is not None]:
            sub._parameters[name] = torch.nn.Parameter(
                mode.fake_tensor_converter.from_meta_and_device(mode, p.detach(), torch.device("cuda")))
    saved = []
    with mode:
        x = torch.zeros(b, cfg.seq_len, cfg.hidden_size, dtype=TORCH_DTYPES[cfg.precision], device="cuda",
                        requires_grad=True)
        with _CudaFlash(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            layer(x)
    params = {storage_id(p) for p in layer.parameters()}
    activations = [t for t in saved if storage_id(t) not in params]
    storages = {storage_id(t): t.untyped_storage().nbytes() for t in activations}
    analytic = layer_saved_tensors(cfg, 1, b, H100)
    assert [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in activations] == \
        [(t.dtype, t.shape) for t in analytic]
    assert sum(storages.values()) == sum(t.bytes for t in analytic)
    assert [(t.shape, t.bytes) for t in analytic if t.dtype == "uint64"] == [([2], 16), ([], 8)]
