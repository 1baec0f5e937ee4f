"""Closed-form saved tensors and FLOPs of the reference Llama model (`mpress/models/llama.py`).

`mpress/static/profile/analytic.py` dispatches here for family "llama"; its conventions hold
(naming by innermost module and saving order, parameters never listed, storage already
counted listed with 0 bytes). What is Llama-specific:

* **Saved tensors** are, in order, what torch 2.13 autograd saves for the model in
  training mode. They are the same on every device except SDPA's: the CPU flash kernel
  saves (k, q, v, log-sum-exp, output), as listed. Where the target is a GPU whose SDPA
  kernel for the block's call is a fused one (`gpu_kernel`: `sdpa_choice.sdpa_kernel`,
  the choice the fake profiler's `cuda_kernels` makes too), that kernel saves the same
  five, its log-sum-exp padded as it pads it (the efficient kernel: to a multiple of 32
  queries), then its random generator's seed and offset (`sdpa_choice.RNG_STATE`: flash
  24 bytes, efficient 16, per attention call); the layer's memory probe runs that kernel
  (`analytic_probe`), so its memory and recompute choices count them. Not modelled: a
  GPU that runs the math path (fp32 with grouped-query heads, bf16 before sm80), listed
  as the CPU kernel saves. RMSNorm is written out (see the model), so its fp32 working
  copy is saved in fp32 under bf16/fp16.
* **FLOPs** count matrix products as `torch.utils.flop_counter.FlopCounterMode` does:
  2·m·n·k per product, scores for all T x T pairs (the causal mask is not discounted).
  Backward is 2 x forward except SDPA's attention, which torch counts as 5 products in
  the backward (the scores are recomputed): 2.5 x its forward. torch counts SDPA only
  on the kernels it knows (CUDA flash, efficient, cuDNN); `mpress/contract/flop_formulas.py`
  gives the CPU kernel the same formulas.

Units: elements and FLOPs; B = microbatch size, T = sequence length, h = hidden size,
f = MLP width, V = vocabulary, nh = query heads, kv = key/value heads, hd = head width.
`act` is the activation dtype's name ("float32", "bfloat16", "float16").
"""

from __future__ import annotations

from typing import Protocol

from mpress.config.model_config import ModelConfig
from mpress.hardware.server import Hardware
from mpress.static.profile.sdpa_choice import (
    FUSED,
    RNG_STATE,
    compute_capability,
    lse_columns,
    sdpa_kernel,
)

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""torch dtype names of the model's precisions."""


class SavedSink(Protocol):
    """Where saved tensors are appended (`analytic._SavedList`)."""

    def add(self, module: str, shape: list[int], dtype: str, what: str, *, alias_of: str | None = None,
            is_input: bool = False, held: bool = False, weight_grad: bool = False) -> str: ...


def gpu_kernel(cfg: ModelConfig, hardware: Hardware | None) -> tuple[tuple[int, int], str] | None:
    """(compute capability, kernel) of `hardware` when it is a GPU whose SDPA kernel for
    `cfg`'s attention (causal, grouped-query heads where kv < nh, with a backward) is a
    fused one (`sdpa_choice.FUSED`); None for eager attention, a CPU target (or none
    given) and the math path."""
    cc = compute_capability(hardware) if hardware is not None else None
    if cc is None or cfg.family != "llama" or cfg.attention != "sdpa":
        return None
    nh, kv, hd = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    kernel = sdpa_kernel(cc, dtype=DTYPE_NAMES[cfg.precision], heads=nh, kv_heads=kv, value_heads=kv, head_dim=hd,
                         value_head_dim=hd, queries=cfg.seq_len, keys=cfg.seq_len, enable_gqa=kv != nh,
                         is_causal=True, grad=True)
    return (cc, kernel) if kernel in FUSED else None


def rms_norm_saved(out: SavedSink, module: str, shape: list[int], act: str, what: str, *,
                   is_input: bool = False) -> None:
    """RMSNorm: pow saves the fp32 input (x itself when x is fp32), rsqrt its output, the
    normalising product both again, the weight product the normalised tensor (in `act`)."""
    half = act != "float32"
    x = out.add(module, shape, "float32", f"{what} input (fp32)", is_input=is_input and not half)
    stats = shape[:-1] + [1]
    rstd = out.add(module, stats, "float32", f"{what} rstd")
    out.add(module, stats, "float32", f"{what} rstd for x * rstd", alias_of=rstd)
    out.add(module, shape, "float32", f"{what} input for x * rstd", alias_of=x, is_input=is_input and not half)
    out.add(module, shape, act, f"{what} normalised input for the weight product")


def embed_saved(cfg: ModelConfig, b: int, out: SavedSink) -> None:
    """The token lookup saves its ids; there is no position table and no dropout."""
    out.add("embed.tok", [b, cfg.seq_len], "int64", "token ids", is_input=True)


def block_saved(cfg: ModelConfig, i: int, b: int, act: str, out: SavedSink, *, kernel: str | None = None) -> None:
    """Block `i` (0-based): attention norm, q/k/v, rotary tables, attention (eager or SDPA),
    output projection, MLP norm, SwiGLU. `kernel`: the fused CUDA kernel SDPA runs
    (`gpu_kernel`), None: the CPU's flash kernel."""
    t, h, f = cfg.seq_len, cfg.hidden_size, cfg.ffn
    nh, kv, hd = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    p = f"layers.{i}"
    rms_norm_saved(out, f"{p}.attn_norm", [b, t, h], act, "attention RMSNorm", is_input=True)
    x = out.add(f"{p}.attn.q_proj", [b * t, h], act, "q/k/v projection input", weight_grad=True)
    out.add(f"{p}.attn.k_proj", [b * t, h], act, "q/k/v projection input", alias_of=x)
    out.add(f"{p}.attn.v_proj", [b * t, h], act, "q/k/v projection input", alias_of=x)
    # q * cos + rotate_half(q) * sin, then the same for k: each product saves its table
    cos = out.add(f"{p}.attn", [t, hd], act, "rotary cos table")
    sin = out.add(f"{p}.attn", [t, hd], act, "rotary sin table")
    out.add(f"{p}.attn", [t, hd], act, "rotary cos table", alias_of=cos)
    out.add(f"{p}.attn", [t, hd], act, "rotary sin table", alias_of=sin)
    if cfg.attention == "sdpa":
        # the kernel saves its inputs by name (key, query, value), then logsumexp, output
        out.add(f"{p}.attn", [b, kv, t, hd], act, "rotated keys for SDPA")
        out.add(f"{p}.attn", [b, nh, t, hd], act, "rotated queries for SDPA")
        out.add(f"{p}.attn", [b, kv, t, hd], act, "values for SDPA (the v projection's output)")
        out.add(f"{p}.attn", [b, nh, lse_columns(kernel, t) if kernel else t], "float32", "SDPA log-sum-exp")
        y = out.add(f"{p}.attn", [b, nh, t, hd], act, "SDPA output", weight_grad=True)
        for name, shape, dtype in RNG_STATE[kernel] if kernel else ():
            out.add(f"{p}.attn", list(shape), dtype, f"CUDA {kernel} kernel's random-generator {name}")
        # the kernel's output is laid out (B, T, nh, hd): the projection input is a view of it
        out.add(f"{p}.attn.o_proj", [b * t, h], act, "output projection input", alias_of=y)
    else:
        # key/value heads repeated to nh; bmm saves its second operand first, then its first
        out.add(f"{p}.attn", [b * nh, hd, t], act, "keys (transposed) for q@k^T")
        out.add(f"{p}.attn", [b * nh, t, hd], act, "rotated queries for q@k^T")
        probs = out.add(f"{p}.attn", [b, nh, t, t], "float32", "attention probabilities (fp32 softmax output)")
        if cfg.dropout > 0:
            out.add(f"{p}.attn.attn_drop", [b, nh, t, t], "bool", "attention-probability dropout mask")
        out.add(f"{p}.attn", [b * nh, t, hd], act, "values for probs@v")
        same = act == "float32" and cfg.dropout == 0  # neither a cast nor dropout made a new tensor
        out.add(f"{p}.attn", [b * nh, t, t], act, "attention probabilities for probs@v",
                alias_of=probs if same else None)
        out.add(f"{p}.attn.o_proj", [b * t, h], act, "output projection input", weight_grad=True)
    rms_norm_saved(out, f"{p}.mlp_norm", [b, t, h], act, "MLP RMSNorm")
    x = out.add(f"{p}.mlp.gate_proj", [b * t, h], act, "gate/up projection input", weight_grad=True)
    out.add(f"{p}.mlp", [b, t, f], act, "SiLU input (gate output)")
    out.add(f"{p}.mlp.up_proj", [b * t, h], act, "gate/up projection input", alias_of=x)
    out.add(f"{p}.mlp", [b, t, f], act, "up output for SiLU(gate) * up")
    out.add(f"{p}.mlp", [b, t, f], act, "SiLU output for SiLU(gate) * up")
    out.add(f"{p}.mlp.down_proj", [b * t, f], act, "down projection input", weight_grad=True)


def head_norm_saved(cfg: ModelConfig, b: int, act: str, out: SavedSink) -> None:
    """The head's final RMSNorm (the vocabulary projection and the loss are every family's)."""
    rms_norm_saved(out, "head.norm", [b, cfg.seq_len, cfg.hidden_size], act, "final RMSNorm", is_input=True)


def _block_flops(cfg: ModelConfig, b: int) -> tuple[float, float]:
    """(projections, attention) FLOPs of one block's forward."""
    t, h, f = cfg.seq_len, cfg.hidden_size, cfg.ffn
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    projections = 2 * b * t * (h * q + 2 * h * kv + q * h + 3 * h * f)  # q, k, v, o, gate, up, down
    attention = 2 * 2 * b * cfg.num_heads * t * t * cfg.head_dim  # q@k^T and probs@v over the query heads
    return float(projections), float(attention)


def layer_forward_flops(cfg: ModelConfig, index: int, b: int) -> float:
    """Matrix-product FLOPs of one forward of layer `index` (0 = embed, 1..L = blocks, L+1 = head)."""
    if index == 0:
        return 0.0
    if index == cfg.num_layers + 1:
        return float(2 * b * cfg.seq_len * cfg.hidden_size * cfg.vocab_size)
    return sum(_block_flops(cfg, b))


def layer_weight_grad_flops(cfg: ModelConfig, index: int, b: int) -> float:
    """FLOPs of the weight-gradient half of layer `index`'s backward: one product per
    projection, as large as its forward (attention has no weights)."""
    if index in (0, cfg.num_layers + 1):
        return layer_forward_flops(cfg, index, b)
    return _block_flops(cfg, b)[0]


def layer_backward_flops(cfg: ModelConfig, index: int, b: int) -> float:
    """Matrix-product FLOPs of one backward of layer `index`: 2 x forward, except SDPA's
    attention (2.5 x: the backward recomputes the scores)."""
    if index in (0, cfg.num_layers + 1):
        return 2.0 * layer_forward_flops(cfg, index, b)
    projections, attention = _block_flops(cfg, b)
    return 2.0 * projections + (2.5 if cfg.attention == "sdpa" else 2.0) * attention
