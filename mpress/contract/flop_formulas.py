"""FLOP formulas for kernels `torch.utils.flop_counter.FlopCounterMode` does not count.

torch counts scaled-dot-product attention on its CUDA kernels (flash, efficient, cuDNN)
but not on the CPU flash kernel that CPU and fake-tensor runs take, so a profile made on
the CPU would miss the attention products (2 in the forward, 5 in the backward, which
recomputes the scores). `EXTRA_FLOP_FORMULAS` gives the CPU kernel torch's own formulas,
so every device counts the same products; pass it as
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


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    """Forward: q@k^T and probs@v for every query head (torch's `sdpa_flop`)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                            out_shape: Any = None, **kwargs: Any) -> int:
    """Backward: the scores again and four gradient products (torch's `sdpa_backward_flop`)."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}
"""Operator packet -> formula over argument shapes (`FlopCounterMode`'s `custom_mapping`)."""

_WRAPPED = {packet: shape_wrapper(formula) for packet, formula in EXTRA_FLOP_FORMULAS.items()}


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """The formula `FlopCounterMode` would use for operator `packet` with
    `EXTRA_FLOP_FORMULAS`, called as `flop_registry`'s are: `formula(*args, **kwargs,
    out_val=out)` -> FLOPs. None for an operator neither counts."""
    return _WRAPPED.get(packet) or flop_registry.get(packet)
