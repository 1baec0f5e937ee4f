"""The `megatron-selective` strategy: Megatron-LM's selective activation recompute, a
baseline users pick instead of mpress.

What it is (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1; Megatron-LM's `--recompute-granularity selective`,
which checkpoints the attention core, `core_attention`, of every transformer layer): a
layer keeps sbh(34 + 5as/h) bytes of activations in fp16 (s sequence length, b
microbatch, h hidden size, a heads); the 5as/h part is the attention core's softmax
output, dropout mask and dropout output, each b x a x s x s, which grow with the square
of the sequence length but cost little to rebuild. Those are dropped after the forward
and rebuilt in the backward; everything else is kept. A fixed policy: every layer of
every stage in every microbatch, no other technique (no swap, no offload); when the
model then does not fit, the strategy does not fit.

How mpress runs it: each layer's profile offers, among its op-level recompute choices,
the set that recomputes its attention core (`RecomputeOption.attention_core`, from
`mpress.selective.attention_core_set`: the saved tensors no matrix product produced
whose two last dimensions are sequence lengths, closed under what the checkpoint
replays together, i.e. with the other dropout masks of the layer, since random
operators are replayed all together). This module gives every layer that choice, in
every microbatch; a layer whose profile offers none (no attention, or attention that
saves no s x s tensor, such as SDPA's fused kernels) is kept, as Megatron keeps it. The
plan is written by the planner's `PlanWriter` like any op-level choice (a keep rule per
kept tensor, then the layer's recompute rule), so the runtime runs it as it runs mpress's.

The runtime checkpoints the whole layer with torch's selective checkpoint, caching the
outputs of the matrix products worth caching (`mpress.selective.worth_caching`) rather
than replaying them; products whose outputs the plain layer does not keep (the qkv
projection before q, k, v are copied out, probs @ v, the output projection and fc2) are
then held until the backward: the memory measured for the choice (what the planner
counts) is the attention core less those outputs.

Units: bytes, seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpress.static.memory import StageCosts
from mpress.static.plan_draft import RECOMPUTE, Draft
from mpress.static.profile import LayerProfile


def attention_core_choice(layer: LayerProfile) -> int | None:
    """The index of `layer`'s recompute option that recomputes its attention core, or None
    when its profile offers none (the layer is then kept)."""
    return next((k for k, o in enumerate(layer.recompute_options) if o.attention_core), None)


def megatron_draft(costs: Sequence[StageCosts], empty: Draft) -> Draft:
    """`empty` (everything kept) with every layer of every stage recomputing its attention
    core in every microbatch (`attention_core_choice`); layers without one stay kept."""
    d = empty.copy()
    for s, c in enumerate(costs):
        for j, layer in enumerate(c.layers):
            choice = attention_core_choice(layer)
            if choice is not None:
                d.layer_tech[s][j] = [RECOMPUTE] * len(d.layer_tech[s][j])
                d.recompute_choice[(s, j)] = choice
    return d
