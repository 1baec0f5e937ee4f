"""Analytic profiler: closed-form per-layer costs of the reference GPT/BERT models (and,
through `analytic_llama.py`, of the Llama family).

Nothing is run or allocated: a 25B-parameter model is profiled in microseconds, so plans
for models far larger than the local machine can be made anywhere.

What the formulas model (see `mpress/models/transformer.py` for the model itself):

* **FLOPs** count matrix products only (2·m·n·k per product): the q/k/v, output, MLP and
  head projections and the two attention products (scores are computed for all T x T
  pairs, also under the causal mask). Elementwise work (LayerNorm, softmax, GELU,
  dropout, adds) and embedding lookups are ignored, so the embedding layer costs 0
  FLOPs. Backward = 2 x forward (one product for the input gradient, one for the weight
  gradient; the attention products need two input gradients, which is also 2 x).
  These are exactly the products `torch.utils.flop_counter.FlopCounterMode` counts.
* **Times** = FLOPs / (hardware.peak_flops(precision) x hardware.compute_efficiency)
  (`flops_time_s`, the one time model of every profile that does not time a real run).
* **Saved tensors** reproduce, in order, what autograd saves in torch 2.x for the
  reference model in training mode, named by the innermost running module (paths of
  `named_modules()` of the whole model) and the order of saving within it; parameters
  are never listed, and the saved index counts only non-parameter tensors. A tensor
  whose storage an earlier saved tensor already holds (the log-probabilities that
  `nll_loss` saves again; attention probabilities when dropout is 0) is listed with
  0 bytes so sums count memory once. Bytes are storage bytes.
* **Mixed precision** (fp16/bf16) is "half model" style, as Megatron-LM trains:
  parameters, gradients and activations in the half dtype, fp32 master weights and Adam
  states in the optimizer. Saved tensors are half except: dropout masks (bool), token
  ids and targets (int64), LayerNorm mean/rstd (fp32: CUDA keeps them in the
  accumulation type; the CPU kernel would keep them half) and the loss's
  log-probabilities (fp32: logits are upcast before the cross entropy). Only the fp32
  profile is checked element by element against the measured one.
* **Model state** per layer: parameters and gradients in the training dtype, Adam
  states 8 bytes/parameter, fp32 master weights 4 bytes/parameter under mixed precision.
* **output_bytes**: the (B, T, h) hidden states each layer hands on; for the head, the
  fp32 scalar loss (4 bytes): the logits never leave the last stage.
* The cross entropy (computed outside any module) counts toward the `head` layer; its
  saved tensors are named `head#i` (the head module itself saves nothing directly).

Units: bytes, FLOPs, seconds; B = microbatch size, T = sequence length, h = hidden
size, f = MLP width, V = vocabulary, nh = heads, hd = h / nh.
"""

from __future__ import annotations

from mpress.config.model_config import ModelConfig
from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.models.layer_counts import (
    layer_largest_parameter,
    layer_name,
    layer_num_parameters,
)
from mpress.static.profile import analytic_llama
from mpress.static.profile.analytic_probe import probed_kind
from mpress.static.profile.profile import LayerProfile, Profile, SavedTensor
from mpress.static.profile.recompute_options import recompute_options, with_producers

TORCH_DTYPE_NAMES = analytic_llama.DTYPE_NAMES
"""torch dtype names of the model's precisions."""

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "bool": 1, "int64": 8, "uint64": 8}

LOSS_BYTES = 4
"""The head's output: an fp32 scalar loss."""


class _SavedList:
    """Collects saved tensors in saving order, numbering them per module."""

    def __init__(self) -> None:
        self.tensors: list[SavedTensor] = []
        self._next_index: dict[str, int] = {}

    def add(self, module: str, shape: list[int], dtype: str, what: str, *, alias_of: str | None = None,
            is_input: bool = False, held: bool = False, weight_grad: bool = False) -> str:
        """Append one saved tensor; `alias_of` (an id) marks storage already counted;
        `is_input`: its storage is the layer's input; `held`: something else holds it;
        `weight_grad`: a linear's input, which its weight gradient reads."""
        index = self._next_index.get(module, 0)
        self._next_index[module] = index + 1
        numel = 1
        for d in shape:
            numel *= d
        nbytes = 0 if alias_of is not None else numel * ELEMENT_BYTES[dtype]
        if alias_of is not None:
            what = f"{what} (same storage as {alias_of})"
        tensor = SavedTensor(module=module, index=index, bytes=nbytes, shape=list(shape), dtype=dtype, what=what,
                             input=is_input, held=held, weight_grad=weight_grad)
        self.tensors.append(tensor)
        return tensor.id


def _layer_norm(out: _SavedList, module: str, shape: list[int], act: str, what: str, *,
                is_input: bool = False) -> None:
    out.add(module, shape, act, f"{what} input", is_input=is_input)
    stats = shape[:-1] + [1]
    out.add(module, stats, "float32" if act != "float32" else act, f"{what} mean")
    out.add(module, stats, "float32" if act != "float32" else act, f"{what} rstd")


def _dropout(out: _SavedList, cfg: ModelConfig, module: str, shape: list[int], what: str) -> None:
    if cfg.dropout > 0:
        out.add(module, shape, "bool", f"{what} dropout mask")


def _embed_saved(cfg: ModelConfig, b: int, out: _SavedList) -> None:
    if cfg.family == "llama":
        return analytic_llama.embed_saved(cfg, b, out)
    t, h = cfg.seq_len, cfg.hidden_size
    out.add("embed.tok", [b, t], "int64", "token ids", is_input=True)
    _dropout(out, cfg, "embed.drop", [b, t, h], "embedding")


def _block_saved(cfg: ModelConfig, i: int, b: int, out: _SavedList, hardware: Hardware | None) -> None:
    t, h, f = cfg.seq_len, cfg.hidden_size, cfg.ffn
    nh = cfg.num_heads
    hd = h // nh
    act = TORCH_DTYPE_NAMES[cfg.precision]
    if cfg.family == "llama":
        gpu = analytic_llama.gpu_kernel(cfg, hardware)
        return analytic_llama.block_saved(cfg, i, b, act, out, kernel=gpu[1] if gpu else None)
    p = f"layers.{i}"
    _layer_norm(out, f"{p}.ln1", [b, t, h], act, "ln1", is_input=True)
    out.add(f"{p}.attn.qkv", [b * t, h], act, "qkv input", weight_grad=True)
    # bmm saves its second operand first, then its first.
    out.add(f"{p}.attn", [b * nh, hd, t], act, "keys (transposed) for q@k^T")
    out.add(f"{p}.attn", [b * nh, t, hd], act, "scaled queries for q@k^T")
    softmax = out.add(f"{p}.attn", [b, nh, t, t], act, "attention probabilities (softmax output)")
    _dropout(out, cfg, f"{p}.attn.attn_drop", [b, nh, t, t], "attention-probability")
    out.add(f"{p}.attn", [b * nh, t, hd], act, "values for probs@v")
    # Without dropout, probs@v saves a view of the softmax output, already counted.
    out.add(f"{p}.attn", [b * nh, t, t], act, "dropped-out attention probabilities for probs@v",
            alias_of=softmax if cfg.dropout == 0 else None)
    out.add(f"{p}.attn.proj", [b * t, h], act, "attention output projection input", weight_grad=True)
    _dropout(out, cfg, f"{p}.attn.resid_drop", [b, t, h], "attention-output")
    _layer_norm(out, f"{p}.ln2", [b, t, h], act, "ln2")
    out.add(f"{p}.mlp.fc1", [b * t, h], act, "fc1 input", weight_grad=True)
    out.add(f"{p}.mlp.act", [b, t, f], act, "GELU input")
    out.add(f"{p}.mlp.fc2", [b * t, f], act, "fc2 input", weight_grad=True)
    _dropout(out, cfg, f"{p}.mlp.drop", [b, t, h], "MLP-output")


def _head_saved(cfg: ModelConfig, b: int, out: _SavedList) -> None:
    t, h, v = cfg.seq_len, cfg.hidden_size, cfg.vocab_size
    act = TORCH_DTYPE_NAMES[cfg.precision]
    if cfg.family == "llama":
        analytic_llama.head_norm_saved(cfg, b, act, out)
    else:
        _layer_norm(out, "head.ln", [b, t, h], act, "final LayerNorm", is_input=True)
    if cfg.family == "bert":
        out.add("head.dense", [b * t, h], act, "MLM transform dense input", weight_grad=True)
        out.add("head.act", [b, t, h], act, "MLM transform GELU input")
        _layer_norm(out, "head.dense_ln", [b, t, h], act, "MLM transform LayerNorm")
    out.add("head.out", [b * t, h], act, "vocabulary projection input", weight_grad=True)
    # Cross entropy = log_softmax (saves its output) + nll_loss (saves that output again,
    # the targets and the total weight), attributed to the head layer.
    logp = out.add("head", [b * t, v], "float32", "log-probabilities (log_softmax output)")
    out.add("head", [b * t, v], "float32", "log-probabilities for nll_loss", alias_of=logp)
    out.add("head", [b * t], "int64", "targets", held=True)  # a view of the iteration's targets
    out.add("head", [], "float32", "nll_loss total weight")


def layer_saved_tensors(cfg: ModelConfig, index: int, microbatch_size: int,
                        hardware: Hardware | None = None) -> list[SavedTensor]:
    """Tensors layer `index` (0 = embed, 1..L = blocks, L+1 = head) saves for backward on
    `hardware` (None: as on the CPU; a GPU changes Llama's SDPA saves, `analytic_llama`)."""
    out = _SavedList()
    if index == 0:
        _embed_saved(cfg, microbatch_size, out)
    elif index == cfg.num_layers + 1:
        _head_saved(cfg, microbatch_size, out)
    else:
        _block_saved(cfg, index - 1, microbatch_size, out, hardware)
    return out.tensors


def layer_forward_flops(cfg: ModelConfig, index: int, microbatch_size: int) -> float:
    """Matrix-product FLOPs of one forward of layer `index` for one microbatch."""
    if cfg.family == "llama":
        return analytic_llama.layer_forward_flops(cfg, index, microbatch_size)
    b, t, h, f, v = microbatch_size, cfg.seq_len, cfg.hidden_size, cfg.ffn, cfg.vocab_size
    tokens = b * t
    if index == 0:
        return 0.0
    if index == cfg.num_layers + 1:
        flops = 2 * tokens * h * v
        if cfg.family == "bert":
            flops += 2 * tokens * h * h  # MLM transform dense
        return float(flops)
    projections = 2 * tokens * (3 * h * h + h * h + 2 * h * f)  # qkv, proj, fc1, fc2
    attention = 2 * 2 * b * t * t * h  # q@k^T and probs@v over all heads
    return float(projections + attention)


def layer_backward_flops(cfg: ModelConfig, index: int, microbatch_size: int) -> float:
    """Matrix-product FLOPs of one backward of layer `index` for one microbatch: 2 x the
    forward (Llama's SDPA differs: see `analytic_llama`)."""
    if cfg.family == "llama":
        return analytic_llama.layer_backward_flops(cfg, index, microbatch_size)
    return 2.0 * layer_forward_flops(cfg, index, microbatch_size)


def layer_weight_grad_flops(cfg: ModelConfig, index: int, microbatch_size: int) -> float:
    """FLOPs of the weight-gradient half of layer `index`'s backward (a split backward's
    W): one product per linear, as large as its forward product; attention's products
    have no weights, so they are all input-gradient work."""
    if cfg.family == "llama":
        return analytic_llama.layer_weight_grad_flops(cfg, index, microbatch_size)
    b, t, h, f = microbatch_size, cfg.seq_len, cfg.hidden_size, cfg.ffn
    if index in (0, cfg.num_layers + 1):
        return layer_forward_flops(cfg, index, microbatch_size)
    return float(2 * b * t * (3 * h * h + h * h + 2 * h * f))


def layer_output_bytes(cfg: ModelConfig, index: int, microbatch_size: int) -> int:
    """Bytes layer `index` hands on: (B, T, h) hidden states, or the fp32 loss for the head."""
    if index == cfg.num_layers + 1:
        return LOSS_BYTES
    return microbatch_size * cfg.seq_len * cfg.hidden_size * cfg.dtype_bytes


def flops_time_s(flops: float, hardware: Hardware, precision: str) -> float:
    """Seconds `flops` matrix-product FLOPs take on one of `hardware`'s devices in
    `precision` (fp32, fp16, bf16): peak FLOP/s x the hardware's compute efficiency."""
    return flops / (hardware.peak_flops(precision) * hardware.compute_efficiency)


def analytic_profile(cfg: ModelConfig, hardware: Hardware, microbatch_size: int) -> Profile:
    """Closed-form `Profile` of the reference model for `cfg` on `hardware` (one microbatch)."""
    if microbatch_size < 1:
        raise UserError(f"microbatch size must be >= 1, got {microbatch_size}")
    layers = []
    for index in range(cfg.num_layers + 2):
        fwd = layer_forward_flops(cfg, index, microbatch_size)
        bwd = layer_backward_flops(cfg, index, microbatch_size)
        n = layer_num_parameters(cfg, index)
        layers.append(LayerProfile(
            name=layer_name(cfg, index),
            forward_flops=fwd,
            backward_flops=bwd,
            weight_grad_flops=layer_weight_grad_flops(cfg, index, microbatch_size),
            forward_time_s=flops_time_s(fwd, hardware, cfg.precision),
            backward_time_s=flops_time_s(bwd, hardware, cfg.precision),
            param_bytes=n * cfg.dtype_bytes,
            grad_bytes=n * cfg.dtype_bytes,
            optim_bytes=8 * n,
            master_bytes=4 * n if cfg.mixed_precision else 0,
            largest_param_bytes=4 * layer_largest_parameter(cfg, index),
            output_bytes=layer_output_bytes(cfg, index, microbatch_size),
            **_layer_memory(cfg, index, microbatch_size, layer_saved_tensors(cfg, index, microbatch_size, hardware),
                            hardware),
        ))
    return Profile(
        model=cfg.name,
        model_fingerprint=cfg.fingerprint(),
        source="analytic",
        device=hardware.name,
        dtype=cfg.precision,
        microbatch_size=microbatch_size,
        layers=layers,
        input_bytes=microbatch_size * cfg.seq_len * 8,  # int64 token ids
        target_bytes=microbatch_size * cfg.seq_len * 8,
    )


def _kind(cfg: ModelConfig, index: int) -> int:
    """A representative of layer `index`'s kind: 0 (embed), 1 (a block: all alike), L+1 (head)."""
    return index if index in (0, cfg.num_layers + 1) else 1


def _layer_memory(cfg: ModelConfig, index: int, microbatch_size: int, saved: list[SavedTensor],
                  hardware: Hardware) -> dict[str, object]:
    """The memory fields of layer `index`'s profile (the memory probe of its kind, read from
    the disk cache when an earlier run made it: `analytic_probe`), its saved tensors with
    their producers, and its op-level recompute choices priced on `hardware` (a GPU that
    runs Llama's SDPA on a fused CUDA kernel: probed with it, `analytic_llama.gpu_kernel`)."""
    gpu = analytic_llama.gpu_kernel(cfg, hardware)
    probed, param_tensors = probed_kind(cfg, _kind(cfg, index), microbatch_size, gpu[0] if gpu else None)
    return {"memory": probed.plain, "recompute_memory": probed.recomputed, "param_tensors": param_tensors,
            "saved": with_producers(saved, probed),
            "recompute_options": recompute_options(saved, probed, hardware, cfg.precision)}
