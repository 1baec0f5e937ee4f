"""Reference Llama-family model (Llama 2 / Llama 3 shapes) in plain PyTorch.

One pre-norm block, as Meta's and Hugging Face's Llama build it (no biases anywhere):

    x = x + O(Attention(RoPE(Q(N1(x))), RoPE(K(N1(x))), V(N1(x))))
    x = x + Down(SiLU(Gate(N2(x))) * Up(N2(x)))

N1/N2 are RMSNorms, RoPE rotates query and key heads by their position, K and V have
`cfg.kv_heads` heads that groups of `num_heads / kv_heads` query heads share
(grouped-query attention). Attention is selectable (`cfg.attention`):

* **eager**: explicit softmax(q k^T / sqrt(hd) + causal bias) v, key/value heads repeated
  to the query heads first and the softmax computed in fp32 (Hugging Face's
  `eager_attention_forward`); autograd saves the (B, nh, T, T) probabilities, so these
  can be swapped or recomputed like any activation.
* **sdpa**: `torch.nn.functional.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)`; the fused kernel saves q, k (kv heads only), v, its output and the
  (B, nh, T) log-sum-exp, and recomputes the probabilities in its backward.

The layer list is the one of `mpress/models/transformer.py` ("embed", "layers.i",
"head"), which builds stages of every family: `Embedding` (token table only: positions
enter through RoPE), `Block`, `Head` (final RMSNorm + untied vocabulary projection).

Why RMSNorm is written out instead of `nn.RMSNorm`: torch's fused kernel runs on CUDA only
and saves (input, rstd) there, while the CPU falls back to a composite that saves fp32
copies, so a CPU or fake-tensor profile would not describe a GPU run. The explicit form
below (Hugging Face's `LlamaRMSNorm`) saves the same tensors on every device.

Rotary tables are computed per call from the sequence length (a few T x hd elements), so
no buffer has to survive building the model on the meta device, and each block stays
independent of the others (a pipeline stage may start at any block).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpress.config.model_config import ModelConfig
from mpress.models.dropout import Dropout


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in fp32 and
    cast back to x's dtype before the weight (Hugging Face's `LlamaRMSNorm`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (B, T, h) fp32; x itself when x is fp32
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)
        return self.weight * (xf * rstd).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, hd) in `dtype`: position p, channel i and i + hd/2 turn by
    p / theta^(2i / hd) (the rotate-half layout of Hugging Face's Llama)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # (T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, hd) `x` by the (T, hd) tables."""
    return x * cos + _rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv, T, hd) -> (B, kv * groups, T, hd): each key/value head repeated for the
    query heads of its group (a copy when groups > 1)."""
    if groups == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, groups, t, hd).reshape(b, kv * groups, t, hd)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions: (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, hd
        self.rope_theta = cfg.rope_theta
        self.sdpa = cfg.attention == "sdpa"
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        # eager only (ModelConfig refuses dropout with sdpa); the identity when p == 0
        self.attn_drop = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        nh, kv, hd = self.num_heads, self.kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(b, t, kv, hd).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(x).view(b, t, kv, hd).transpose(1, 2)  # (B, kv, T, hd)
        cos, sin = rotary_tables(t, hd, self.rope_theta, x.dtype, x.device)  # (T, hd) each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sdpa:
            y = _sdpa(q, k, v)  # (B, nh, T, hd)
        else:
            y = self._eager(q, repeat_kv(k, nh // kv), repeat_kv(v, nh // kv))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, nh * hd))

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd) + causal bias) v, all (B, nh, ., .)."""
        t = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        # additive 0/-inf bias built per call: an add saves nothing for backward
        scores = scores + torch.full((t, t), float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
        probs = self.attn_drop(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype))  # (B, nh, T, T)
        return probs @ v  # (B, nh, T, hd)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of (B, nh, T, hd) queries and (B, kv, T, hd) keys and values.

    On the meta device (the analytic profiler's memory probe) torch has no fused kernel
    to choose and would take the math path, which saves the (B, nh, T, T) probabilities
    that no fused kernel keeps: there the CPU flash kernel's meta function stands in, so
    the probe sees what a real run saves (a probe for a GPU runs the GPU's kernel in its
    place: the profiler's `cuda_kernels.CudaKernels`)."""
    if q.device.type == "meta":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class MLP(nn.Module):
    """SwiGLU: Down(SiLU(Gate(x)) * Up(x)), h -> ffn -> h."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-RMSNorm Llama block: (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """(B, T) int64 token ids -> (B, T, h); no position table (RoPE), no dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


class Head(nn.Module):
    """(B, T, h) -> (B, T, vocab): final RMSNorm + vocabulary projection (untied, no bias)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))
