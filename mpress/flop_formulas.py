"""FLOP formulas for kernels `torch.utils.flop_counter.FlopCounterMode` does not count.

torch counts scaled-dot-product attention on its CUDA kernels (flash, efficient, cuDNN)
but not on the CPU flash kernel that CPU and fake-tensor runs take, so a profile made on
the CPU would miss the attention products (2 in the forward, 5 in the backward, which
recomputes the scores). `EXTRA_FLOP_FORMULAS` gives the CPU kernel torch's own formulas,
so every device counts the same products; pass it as
`FlopCounterMode(custom_mapping=EXTRA_FLOP_FORMULAS)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

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
