"""Fake profiles for a GPU save what CUDA's kernels save (`cuda_kernels.py`).

The first tests run on any torch: a GPU target's fake profile differs from the CPU
target's by the module docstring's table, byte for byte. The others check the table
against torch's own fake CUDA tensors, which only a CUDA build of torch has (the GPU
machines' 2.11+cu130; `.ci/torch-2.11` runs them): each operator's saved tensors on
fake CUDA equal those of the fake CPU run under `CudaKernels`. Without a GPU, fake CUDA
tensors run a forward but no backward, so only forwards' saves are compared."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from mpress.hardware.server import load_hardware
from mpress.static.profile.cuda_kernels import CudaKernels, attention_kernel
from mpress.static.profile.fake_profile import fake_profile
from mpress.static.profile.sdpa_choice import compute_capability

B, T, HEADS, HEAD_DIM = 2, 100, 4, 16
HIDDEN = HEADS * HEAD_DIM
H100, V100 = (9, 0), (7, 0)
cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                reason="fake CUDA tensors need a CUDA build of torch (no GPU needed)")


class Block(nn.Module):
    """LayerNorm, causal self-attention (SDPA), dropout: one of each row of the table."""

    def __init__(self, attn_dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, dtype=dtype)
        self.drop = nn.Dropout(0.1)
        self.attn_dropout = attn_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_dropout)
        return x + self.drop(a.transpose(1, 2).reshape(B, T, HIDDEN))


def _factory():
    model = nn.Sequential(Block())
    return model, torch.randn(B, T, HIDDEN, dtype=torch.bfloat16), lambda out: out.float().square().mean()


def test_a_gpu_targets_fake_profile_differs_from_the_cpus_by_the_table():
    """bf16, no attention dropout: CUDA saves a bool mask for the dropout (1 B/element
    less than the CPU's bf16 noise), fp32 LayerNorm statistics (2 B/row more, twice),
    and flash attention's RNG state (24 B) beside the logsumexp both flash kernels keep."""
    gpu = fake_profile(_factory, model_name="block", hardware=load_hardware("hgx-h100"))
    cpu = fake_profile(_factory, model_name="block", hardware=load_hardware("cpu-local"))
    rows = B * T
    expected = -B * T * HIDDEN * (2 - 1) + 2 * rows * (4 - 2) + 24
    assert sum(x.saved_bytes for x in gpu.layers) - sum(x.saved_bytes for x in cpu.layers) == expected
    dtypes = {x.dtype for layer in gpu.layers for x in layer.saved}
    assert "bool" in dtypes and "uint64" in dtypes, dtypes
    kept = [x.memory.kept_bytes for x in gpu.layers], [x.memory.kept_bytes for x in cpu.layers]
    assert sum(kept[0]) - sum(kept[1]) == expected  # the probe's figures follow


def test_the_target_gpu_picks_the_attention_kernel():
    q = torch.empty(B, HEADS, T, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(B, 1, T, T, dtype=torch.bool, device="meta")
    assert attention_kernel(H100, q, q, q, None) == "flash"
    assert attention_kernel(H100, q, q, q, mask) == "efficient"  # flash takes no mask
    assert attention_kernel(V100, q.half(), q.half(), q.half(), None) == "efficient"  # no flash before sm80
    assert attention_kernel(V100, q, q, q, None) == "math"  # no bf16 kernel on sm70
    wide = torch.empty(B, HEADS, T, 512, dtype=torch.float16, device="meta")
    assert attention_kernel(H100, wide, wide, wide, None) == "efficient"  # flash: head dim <= 256
    assert compute_capability(load_hardware("dgx1-v100")) == V100
    grouped = torch.empty(B, 1, T, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    assert attention_kernel(H100, q, grouped, grouped, None, enable_gqa=True) == "flash"  # flash takes GQA
    assert attention_kernel(V100, q.half(), grouped.half(), grouped.half(), None, enable_gqa=True) == "math"
    assert attention_kernel(H100, q, grouped, grouped, mask, enable_gqa=True) == "math"  # efficient takes no GQA
    odd = torch.empty(B, HEADS, T, 12, dtype=torch.float32, device="meta")
    assert attention_kernel(H100, odd, odd, odd, None) == "efficient"  # fp32: head dims % 4
    short = torch.empty(B, HEADS, T // 2, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    assert attention_kernel(H100, short, q, q, None, is_causal=True) == "efficient"  # flash: causal needs Tq == Tk
    assert attention_kernel(H100, short, q, q, None) == "flash"
    head = torch.empty(B, HEADS, T, 256, dtype=torch.float16, device="meta")
    assert attention_kernel((8, 6), head, head, head, None, grad=True) == "efficient"  # sm86: flash backward <= 192
    assert attention_kernel((8, 6), head, head, head, None) == "flash"
    assert attention_kernel(H100, head, head, head, None, grad=True) == "flash"
    assert compute_capability(load_hardware("hgx-h100")) == H100
    assert compute_capability(load_hardware("cpu-local")) is None


def _attend(mask_and_dropout):
    mask, dropout = mask_and_dropout

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.device),
                                              dropout_p=dropout)
    return attend


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_math_path_saves_cudas_fp32_scores_not_cpu_flash(dropout):
    """bf16 on a V100 (no bf16 kernel): CUDA runs the math path, which keeps the fp32
    scores and probabilities (B x H x T x T) and, with dropout, a bool mask (before: plain
    SDPA on CPU ran CPU flash without dropout, and kept fp32 noise with it)."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    with FakeTensorMode(allow_non_fake_inputs=True), CudaKernels(V100):
        saves = _saves(_attend((mask, dropout)), *(_act("cpu", torch.bfloat16, (B, HEADS, T, HEAD_DIM))
                                                   for _ in range(3)))
    square = [(d, n) for d, shape, n in saves if shape[-2:] == (T, T)]
    assert ("float32", B * HEADS * T * T * 4) in square
    assert [d for d, _n in square if d != "float32"] == (["bool"] if dropout else [])


# ---- against fake CUDA tensors (a CUDA build of torch) ------------------------------

def _saves(fn, *args) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, shape, storage bytes) of each tensor autograd saves in `fn(*args)`'s forward."""
    out = []

    def pack(t):
        out.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


def _both(fn, make, cc=H100, cuda_mode=contextlib.nullcontext):
    """`fn`'s forward saves on fake CUDA tensors (the reference) and on fake CPU ones
    under `CudaKernels(cc)`; `make(device)` builds the inputs."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        with cuda_mode():
            on_cuda = _saves(fn, *make("cuda"))
        with CudaKernels(cc):
            on_cpu = _saves(fn, *make("cpu"))
    return on_cuda, on_cpu


def _act(device, dtype, shape=(B, T, HIDDEN)):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)


@cuda_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_and_layer_norm_save_as_on_cuda(dtype):
    on_cuda, on_cpu = _both(lambda x: F.dropout(x, 0.1, True), lambda d: (_act(d, dtype),))
    assert on_cuda == on_cpu and on_cuda[0][0] == "bool"
    on_cuda, on_cpu = _both(lambda x, w: F.layer_norm(x, (HIDDEN,), w, w),
                            lambda d: (_act(d, dtype), _act(d, dtype, (HIDDEN,))))
    assert on_cuda == on_cpu and ("float32", (B, T, 1), B * T * 4) in on_cuda


class _Kernel(TorchFunctionMode):
    """On fake CUDA tensors SDPA cannot ask the device (it takes the math path): this
    calls the given CUDA kernel, as a GPU of the test's kind would."""

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        q, k, v = args[:3]
        kw = kwargs or {}
        if self.kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, kw.get("dropout_p", 0.0), kw.get("is_causal", False))[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, kw.get("dropout_p", 0.0), kw.get("is_causal", False))[0]


@cuda_build
@pytest.mark.parametrize("cc, dtype, kernel", [(H100, torch.bfloat16, "flash"), (V100, torch.float16, "efficient"),
                                               (H100, torch.float32, "efficient")])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_saves_as_the_gpus_kernel(cc, dtype, kernel, dropout):
    """Flash: logsumexp B x H x T fp32 and RNG state; efficient: logsumexp padded to 32
    columns and seed and offset; neither the math path's T x T scores the CPU keeps."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

    def make(device):
        return tuple(_act(device, dtype, (B, HEADS, T, HEAD_DIM)) for _ in range(3))

    on_cuda, on_cpu = _both(attend, make, cc, lambda: _Kernel(kernel))
    assert on_cuda == on_cpu
    columns = T if kernel == "flash" else -(-T // 32) * 32
    assert ("float32", (B, HEADS, columns), B * HEADS * columns * 4) in on_cuda
    assert all(shape[-2:] != (T, T) for _d, shape, _n in on_cuda)


@cuda_build
def test_a_blocks_forward_saves_as_on_cuda():
    """A whole block (bf16, dropout on, causal attention) saves on fake CPU tensors under
    `CudaKernels` what it saves on fake CUDA ones, where torch's own CUDA dropout and
    LayerNorm kernels run (only the attention kernel is given, as on an H100)."""
    def make(device):
        with torch.device(device):
            block = Block(attn_dropout=0.1)
        return block, _act(device, torch.bfloat16)

    on_cuda, on_cpu = _both(lambda block, x: block(x), make, H100, lambda: _Kernel("flash"))
    assert on_cuda == on_cpu
    assert sum(n for _d, _s, n in on_cuda) > 0


@cuda_build
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_math_path_saves_as_on_cuda(dropout):
    """Fake CUDA tensors take SDPA's math path (they cannot ask the device): what the
    fake CPU run saves for a GPU that runs math (bf16 on a V100, a bool mask) is the same."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()

    def make(device):
        return tuple(_act(device, torch.bfloat16, (B, HEADS, T, HEAD_DIM)) for _ in range(3))

    on_cuda, on_cpu = _both(_attend((mask, dropout)), make, V100)
    assert on_cuda == on_cpu


@cuda_build
def test_grouped_query_flash_saves_as_on_cuda():
    """GQA on an H100: flash with the fewer key/value heads (no repeated copies)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def make(device):
        q = _act(device, torch.bfloat16, (B, HEADS, T, HEAD_DIM))
        return q, *(_act(device, torch.bfloat16, (B, 1, T, HEAD_DIM)) for _ in range(2))

    on_cuda, on_cpu = _both(attend, make, H100, lambda: _Kernel("flash"))
    assert on_cuda == on_cpu
    assert ("bfloat16", (B, 1, T, HEAD_DIM), B * T * HEAD_DIM * 2) in on_cpu


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_saves_the_fused_kernels_three_tensors_and_computes_rms_norm(weighted):
    """For a GPU target RMSNorm saves what CUDA's `_fused_rms_norm` saves: the input, the
    weight, rstd fp32 per row (before: the CPU composite's fp32 copies of the input, about
    8 B per bf16 element more); its values and gradients are RMSNorm's."""
    def norm(x, w):
        return F.rms_norm(x, (HIDDEN,), w if weighted else None, 1e-5)

    def make(device):
        return _act(device, torch.bfloat16), _act(device, torch.bfloat16, (HIDDEN,))

    with FakeTensorMode(allow_non_fake_inputs=True), CudaKernels(H100):
        saves = _saves(norm, *make("cpu"))
    weight = [("bfloat16", (HIDDEN,), HIDDEN * 2)] if weighted else []
    assert saves == [("bfloat16", (B, T, HIDDEN), B * T * HIDDEN * 2), *weight, ("float32", (B, T, 1), B * T * 4)]
    x, w = (t.detach().float().requires_grad_() for t in make("cpu"))
    with CudaKernels(H100):
        out = norm(x, w)
    out.square().sum().backward()
    grads = x.grad, w.grad
    x.grad = w.grad = None
    expected = norm(x, w)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads[0], x.grad)
    if weighted:
        torch.testing.assert_close(grads[1], w.grad)


@cuda_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", ["same", "none", "fp32"])
def test_rms_norm_saves_as_on_cuda(dtype, weight):
    """Fused when the weight has the input's dtype or there is none; else the composite."""
    def make(device):
        w = None if weight == "none" else _act(device, dtype if weight == "same" else torch.float32, (HIDDEN,))
        return _act(device, dtype), w

    on_cuda, on_cpu = _both(lambda x, w: F.rms_norm(x, (HIDDEN,), w, 1e-5), make)
    assert on_cuda == on_cpu
