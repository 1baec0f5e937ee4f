"""What CUDA's kernels save for backward, on fake CPU tensors: fake profiles for a GPU.

A fake profile (`fake_profile.py`) runs the model's forward and backward on fake tensors
standing on the CPU, so by default autograd saves what the CPU's kernels save. A GPU
training run saves something else for four kinds of operator (torch 2.11 and 2.13):

=====================  ==========================================  ==========================================
operator               CPU kernel saves                            CUDA kernel saves (CUDA - CPU, bytes)
=====================  ==========================================  ==========================================
dropout (train,        `_dropout`: the noise, act dtype            `native_dropout`: a bool mask
0 < p < 1)             (itemsize B/element)                        (numel x (1 - itemsize))
`native_layer_norm`    mean and rstd in the input's dtype          mean and rstd fp32, rows x 1 each
of fp16/bf16 input     (rows x itemsize each)                      (2 x rows x (4 - itemsize))
scaled dot-product     training with dropout: the math path        flash (sm80+, fp16/bf16, head dim <= 256
attention              (fp32 scores, probabilities and noise,      and % 8, no mask, grouped-query heads
                       B x H x Tq x Tk each); without: CPU flash   allowed): q, k, v, out, logsumexp
                       (q, k, v, out, logsumexp B x H x Tq fp32)   B x H x Tq fp32, RNG state uint64[2] +
                                                                   uint64 (24 B); else efficient (no
                                                                   grouped-query heads): logsumexp
                                                                   B x H x ceil(Tq/32)*32 fp32, seed and
                                                                   offset int64 (16 B), the mask as an
                                                                   additive bias; else math: fp32 scores
                                                                   and probabilities, dropout's bool mask
=====================  ==========================================  ==========================================

`CudaKernels` makes the fake CPU run save what the GPU saves, at the source, so every
figure the profile derives from the saved tensors (kept bytes, peaks, recompute choices)
follows: dropout calls `native_dropout` (CPU has that kernel), attention calls the CUDA
kernel the target GPU picks (`attention_kernel`, the choice of `sdpa_choice.py`: torch's
fake implementations of `_scaled_dot_product_flash_attention` and
`_scaled_dot_product_efficient_attention` run on CPU fake tensors, forward and backward;
the math path is the device-generic `_scaled_dot_product_attention_math`, its dropout
given as a bool mask), and LayerNorm's statistics come out fp32 (`CUDA_STATISTICS`). On
the meta device, where the reference Llama calls the CPU flash kernel in SDPA's place
(`mpress/models/llama.py`; the analytic profile's memory probe runs there), that call is
SDPA as well: the GPU's kernel runs. `tests/static/profile/test_cuda_kernels.py` checks
each row against torch's own fake CUDA tensors under a CUDA build of torch.

Why not fake CUDA tensors themselves: without a GPU, a CUDA build of torch runs their
forward (saved tensors as the GPU's kernels have them) but its autograd engine stops in
the backward ("hasPrimaryContext expects a valid device index"), a CPU-only build aborts
the process once autograd sees them, and SDPA cannot ask the device which kernel it runs
(it falls back to the math path). The forward alone is what the test compares.

RMSNorm (`F.rms_norm`, weight of the input's dtype or none) is CUDA's `_fused_rms_norm`,
which saves the input, the weight and rstd (rows x 1, fp32); the CPU's composite saves
fp32 copies of the input on the way (about 8 B per element more for fp16/bf16 input):
`FusedRmsNorm` saves what CUDA's kernel saves.

Not covered (a GPU saves them as the CPU's table row says): `native_group_norm`
statistics, in-place dropout.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mpress.static.profile.sdpa_choice import sdpa_kernel

HALF = (torch.float16, torch.bfloat16)

CUDA_STATISTICS = {torch.ops.aten.native_layer_norm.default: (1, 2)}
"""Outputs CUDA's kernel returns (and autograd saves) in fp32 whatever the input's dtype:
LayerNorm's mean and rstd."""

EFFICIENT_MASK_ALIGNMENT = 16
"""torch pads an additive attention bias's last dimension to a multiple of this for the
efficient kernel and saves the padded storage (`attention.cpp`, `preprocess_mask`)."""


def attention_kernel(cc: tuple[int, int], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None, enable_gqa: bool = False, is_causal: bool = False,
                     grad: bool = False) -> str:
    """"flash", "efficient" or "math": the kernel SDPA runs for these tensors on a GPU of
    compute capability `cc` (`sdpa_choice.sdpa_kernel`, which the analytic Llama profile
    reads too). `grad`: the backward will run."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    return sdpa_kernel(cc, dtype=str(query.dtype).removeprefix("torch."), heads=query.size(1),
                       kv_heads=key.size(1), value_heads=value.size(1), head_dim=query.size(-1),
                       value_head_dim=value.size(-1), queries=query.size(-2), keys=key.size(-2),
                       mask=attn_mask is not None, enable_gqa=enable_gqa, is_causal=is_causal, grad=grad)


def _additive(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """An SDPA mask as an additive bias in the query's dtype (a bool mask: -inf where False)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(query.dtype)


def _bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """An SDPA mask as the efficient kernel takes it: additive, in the query's dtype, last
    dimension padded to `EFFICIENT_MASK_ALIGNMENT` (then viewed back), expanded to B x H x Tq x Tk."""
    mask = _additive(mask, query)
    tk = mask.size(-1)
    pad = -tk % EFFICIENT_MASK_ALIGNMENT
    if pad:
        mask = F.pad(mask, (0, pad))[..., :tk]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


class _Statistics(TorchDispatchMode):
    """Returns `CUDA_STATISTICS` outputs of fp16/bf16 inputs in fp32, as CUDA's kernels do."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        which = CUDA_STATISTICS.get(func)
        if which is None or args[0].dtype not in HALF:
            return out
        return tuple(t.float() if i in which else t for i, t in enumerate(out))


class _Functions(TorchFunctionMode):
    """Attention and dropout as a GPU of compute capability `cc` runs them."""

    def __init__(self, cc: tuple[int, int]) -> None:
        super().__init__()
        self.cc = cc

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in _CPU_FLASH and args[0].device.type == "meta":
            return self._cpu_flash(*args, **kwargs)
        if func in (F.dropout, torch.dropout):
            return _dropout(func, *args, **kwargs)
        if func in (F.rms_norm, torch.rms_norm):
            return _rms_norm(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _cpu_flash(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                   is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU flash kernel called on the meta device, where a model stands it in for
        SDPA (`mpress/models/llama.py`: torch picks no fused kernel on meta): the GPU's
        kernel instead, grouped-query heads as SDPA's `enable_gqa` takes them. Returns
        (output, the kernel's second output) as the CPU kernel's (output, logsumexp)."""
        return self._kernel(query, key, value, attn_mask, dropout_p, is_causal, scale,
                            key.size(1) != query.size(1))[:2]

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        return self._kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]

    def _kernel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[Any, ...]:
        """All outputs of the kernel the GPU runs for this SDPA call (the output first)."""
        grad = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
        kernel = attention_kernel(self.cc, query, key, value, attn_mask, enable_gqa, is_causal, grad)
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)
        if kernel == "efficient":
            bias = _bias(attn_mask, query, key) if attn_mask is not None else None
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, grad, dropout_p, is_causal, scale=scale)
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, ...]:
    """SDPA's math path as CUDA runs it (`_scaled_dot_product_attention_math`, device
    generic: fp32 scores and probabilities for fp16/bf16 input). Plain SDPA on CPU would
    pick CPU flash instead. Its dropout is given as a bool mask: CUDA's `at::dropout` is
    the fused kernel (a bool mask saved), the CPU's saves a noise tensor in fp32."""
    mask = _additive(attn_mask, query) if attn_mask is not None else None
    keep = None
    if dropout_p > 0:
        shape = (*query.shape[:-1], key.size(-2))
        keep = torch.empty(shape, dtype=torch.bool, device=query.device).bernoulli_(1 - dropout_p)
    with warnings.catch_warnings():  # torch warns that a given dropout mask is for tests
        warnings.filterwarnings("ignore", "Dropout mask should only be used")
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, keep, scale=scale, enable_gqa=enable_gqa)


_CPU_FLASH = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
"""The CPU flash kernel, as a call names it (the operator, or its overload)."""


_ACTIVE: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("mpress_cuda_kernels", default=None)
"""The compute capability of the `CudaKernels` block the calling thread is in."""


class CudaKernels:
    """Within it, fake CPU tensors save for backward what a GPU of compute capability
    `cc` saves (see the module docstring). Enter it inside the fake mode. A checkpointed
    forward enters `in_recompute()` as well: torch function modes are not active in the
    backward, where a checkpoint recomputes."""

    def __init__(self, cc: tuple[int, int]) -> None:
        self.cc = cc
        self._modes = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self._token = _ACTIVE.set(self.cc)
        self._modes.enter_context(_Statistics())
        self._modes.enter_context(_Functions(self.cc))
        return self

    def __exit__(self, *exc: object) -> None:
        self._modes.close()
        _ACTIVE.reset(self._token)


def in_recompute() -> contextlib.AbstractContextManager:
    """What a checkpointed forward enters so that its recompute runs the kernels its
    forward ran: the attention and dropout of the enclosing `CudaKernels`, if any (its
    statistics mode, a dispatch mode, stays active in the backward by itself)."""
    cc = _ACTIVE.get()
    return _Functions(cc) if cc is not None else contextlib.nullcontext()


def _rms_norm(func: Any, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    """RMSNorm as CUDA runs it: `_fused_rms_norm` when the weight (if any) has the input's
    dtype (`FusedRmsNorm`); else torch's composite, as on CUDA."""
    if weight is not None and weight.dtype != input.dtype:
        return func(input, normalized_shape, weight, eps)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return FusedRmsNorm.apply(input, weight, len(shape), torch.finfo(input.dtype).eps if eps is None else eps)


class FusedRmsNorm(torch.autograd.Function):
    """CUDA's `_fused_rms_norm` on any device: saves the input, the weight and rstd (fp32,
    the normalized dimensions kept as 1), as the CUDA kernel does; CPU's composite saves
    fp32 copies of the input on the way. Computes in fp32, like both."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, ndim: int, eps: float) -> torch.Tensor:
        dims = tuple(range(-ndim, 0))
        x = input.float()
        rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        out = (x * rstd).to(input.dtype)
        ctx.dims = dims
        ctx.save_for_backward(input, weight, rstd)
        return out if weight is None else out * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, rstd = ctx.saved_tensors
        dims = ctx.dims
        normed = input.float() * rstd
        g = grad.float()
        grad_weight = None
        if weight is not None:
            lead = tuple(range(grad.dim() - len(dims)))
            grad_weight = (g * normed).sum(lead).to(weight.dtype)
            g = g * weight.float()
        grad_input = rstd * (g - normed * (g * normed).mean(dims, keepdim=True))
        return grad_input.to(input.dtype), grad_weight, None, None


def _dropout(func: Any, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
             train: bool | None = None) -> torch.Tensor:
    """Dropout as CUDA runs it: the fused `native_dropout` (its bool mask saved).
    `F.dropout(input, p, training, inplace)` or `torch.dropout(input, p, train)`."""
    training = training if train is None else train
    if training and 0 < p < 1 and not inplace and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return func(input, p, training, inplace) if func is F.dropout else func(input, p, training)
