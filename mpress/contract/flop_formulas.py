"""FLOP formulas for kernels `torch.utils.flop_counter.FlopCounterMode` does not count,
or counts only in some torch versions.

torch counts scaled-dot-product attention on its CUDA kernels (flash, efficient, cuDNN)
but not on the CPU flash kernel that CPU and fake-tensor runs take, so a profile made on
the CPU would miss the attention products (2 in the forward, 5 in the backward, which
recomputes the scores). And torch <= 2.11's formulas refuse grouped-query attention
(key/value with fewer heads than the query, as Llama-3, Mistral and Qwen run it):
`sdpa_flop_count` asserts equal head counts, so every profile of such a model failed on
the GPU machines' torch. `EXTRA_FLOP_FORMULAS` gives the CPU kernel, and the CUDA
kernels again, torch's own formulas over the key/value heads broadcast to the query's
(what the kernels compute; torch 2.13's formulas count GQA the same way), so every
device and torch version counts the same products; pass it as
`FlopCounterMode(custom_mapping=EXTRA_FLOP_FORMULAS)`, or look one operator up with
`flop_formula` (as `torch.utils.flop_counter.flop_registry` is read).

Shared by the static half (profilers) and the op-level recompute (`mpress.contract.selective`),
which the runtime uses too, so it lives outside both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten


def _query_heads(query_shape: Any, shape: Any) -> tuple[int, ...]:
    """A (B, H_kv, S, D) key or value shape with the query's H heads: grouped-query
    attention broadcasts each key/value head to H / H_kv query heads."""
    return (shape[0], query_shape[1], *shape[2:])


def _sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
               **kwargs: Any) -> int:
    """Forward: q@k^T and probs@v for every query head (torch's `sdpa_flop`)."""
    return sdpa_flop_count(query_shape, _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape))


def _sdpa_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                        out_shape: Any = None, **kwargs: Any) -> int:
    """Backward: the scores again and four gradient products (torch's `sdpa_backward_flop`)."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, _query_heads(query_shape, key_shape),
                                    _query_heads(query_shape, value_shape))


EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    **{packet: _sdpa_flop for packet in (
        aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention)},
    **{packet: _sdpa_backward_flop for packet in (
        aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward)},
}
"""Operator packet -> formula over argument shapes (`FlopCounterMode`'s `custom_mapping`)."""

_WRAPPED = {packet: shape_wrapper(formula) for packet, formula in EXTRA_FLOP_FORMULAS.items()}


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """The formula `FlopCounterMode` would use for operator `packet` with
    `EXTRA_FLOP_FORMULAS`, called as `flop_registry`'s are: `formula(*args, **kwargs,
    out_val=out)` -> FLOPs. None for an operator neither counts."""
    return _WRAPPED.get(packet) or flop_registry.get(packet)
