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
`mpress.contract.selective.attention_core_set`: the saved tensors made by the operators between
q @ k^T and probs @ v in the layer's traced dataflow, told by where they sit rather than
by their shapes, closed under what the checkpoint replays together, i.e. with the other
dropout masks of the layer, since random operators are replayed all together). This
module gives every layer that choice, in every microbatch; a layer whose profile offers
none (no attention, or attention that saves no s x s tensor, such as SDPA's fused
kernels) is kept, as Megatron keeps it. The plan is written by the planner's
`PlanWriter` like any op-level choice (a keep rule per kept tensor, then the layer's
recompute rule), so the runtime runs it as it runs mpress's.

Known bias of this baseline, in mpress's favour: it frees less than Megatron-LM does.
Megatron-LM checkpoints only `core_attention` (its inputs q, k, v and its output are
kept by the layer anyway), so it frees the whole 5as/h sbh. mpress instead checkpoints
the whole layer with torch's selective checkpoint, caching the outputs of the matrix
products worth caching (`mpress.contract.selective.worth_caching`) rather than replaying them;
products whose outputs the plain layer does not keep (the qkv projection before q, k, v
are copied out, 3sbh; probs @ v, the output projection and fc2, sbh each; 2 bytes per
element) are then held until the backward, 12 sbh bytes, while the replay of all random
operators frees the two other dropout masks, 2 sbh. Per block it frees
(5as/h + 2 - 12) sbh bytes where Megatron-LM frees 5as/h sbh (measured by
tests/static/plan/test_megatron.py's probe; the planner counts what the probe measures). For
GPT-20.4B (configs/models/gpt-20.4b.yaml: a = 40, s = 1024, h = 5120, so as/h = 8) that
is 30 sbh freed against Megatron's 40 sbh, of a block's 74 sbh (a gpt block with the
same as/h, h = 256, a = 4, s = 512, b = 2, probed in fp16: 74.06 sbh kept plain, 40 sbh
core, 30 sbh freed): each block keeps 44 sbh where Megatron's would keep 34, 10 sbh =
105 MB more per block and microbatch in flight at microbatch 2 (sbh = 1024 x 2 x 5120). So megatron-selective peaks higher, and fits
smaller models, than Megatron-LM's own selective recompute would, and comparisons of
mpress against this baseline overstate mpress's advantage over Megatron-LM. Left as is
(not re-architected): matching Megatron needs a checkpoint around the attention core
alone; torch's selective checkpoint of the whole layer replays every operator it does not
cache, so not caching those products would recompute them instead.

Units: bytes, seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpress.static.memory.stage_costs import StageCosts
from mpress.static.plan.plan_draft import RECOMPUTE, Draft
from mpress.static.profile.profile import LayerProfile


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
