"""Op-level (selective) recompute: a plan recomputes some of a layer's saved tensors and
keeps the rest. Both halves call this module, so what the profiler measured and the
planner chose is exactly what the runtime replays.

How a layer is recomputed in part: its forward runs under non-reentrant
`torch.utils.checkpoint` (random state preserved) with torch's selective checkpoint
contexts (`create_selective_checkpoint_contexts`). The policy names, by their ordinal in
the layer's forward, the operators whose outputs are *cached* (kept on the device until
the backward); every other operator is replayed by the backward's recompute, which
stops after the last saved tensor is rebuilt (checkpoint's early stop).

Which operators are cached (`cached_ops`): the producer of every saved tensor the plan
keeps (the operator that last wrote its storage in this layer's forward). Two closures
follow from torch's semantics and are checked, not guessed (`closed_set`):

- an operator's outputs are cached together, so recomputing one saved tensor of an
  operator frees nothing unless all its saved tensors are recomputed: the set of a
  plan must hold all or none of each producer's tensors;
- random operators (dropout) draw from the random stream the checkpoint restores: if
  one is replayed, all before and after it must be too, or the stream shifts and the
  masks differ. So random operators are replayed all together or cached all together.

Torch's cache refuses an entry whose tensor changed after it was cached, and an
operator writing in place is seen by the policy before torch bumps the version of what
it wrote: operators that write in place, or whose output a later one writes in place,
are never cached (`OpCost.cacheable`), so what they produce is recomputed; when one
random operator cannot be cached (CPU's dropout: `bernoulli_` then `div_`), all replay.
Operators after the last saved tensor are never cached (the replay stops before them).
The policy checks, op by op, that the forward runs the operators of the trace (an
autocast or a data-dependent branch would shift every ordinal) and refuses otherwise.

A saved tensor no operator of the layer produced (the layer's input, a buffer, a
tensor saved by the loss outside the layer) has no producer: the checkpoint holds the
input anyway and the rest is kept; a plan's word for it changes nothing.

The trace (`trace_layer_ops`): one forward of the layer under a `TorchDispatchMode`
that lists the operators the selective policy sees (torch's `SAC_IGNORED_OPS` left out,
as the policy leaves them out) with what re-running each costs: matrix-product FLOPs
(torch's flop counter formulas) and bytes read and written (views move nothing), so
the hardware model can turn both into time (`op_time_s`), and which earlier operator
wrote each input (`OpCost.reads`: the layer's dataflow, by which `attention_core` tells
the attention core by where it sits). Storage identity is the storage object
(`untyped_storage()._cdata`): fake and meta storages all sit at address 0.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from mpress.errors import PlanError
from mpress.contract.flop_formulas import flop_formula
from mpress.contract.live_bytes import tensors_in


@dataclass(frozen=True)
class OpCost:
    """One operator of a layer's forward, as the recompute would re-run it."""

    name: str
    """Operator overload, e.g. "aten.mm.default"."""
    flops: float
    """Matrix-product FLOPs (0 for everything torch's flop counter does not count)."""
    bytes_moved: int
    """Bytes of its tensor inputs and outputs (0 for a view)."""
    random: bool
    """It draws from the random stream (dropout)."""
    out_bytes: int = 0
    """Bytes of its tensor outputs (what caching them holds)."""
    overwritten: bool = False
    """A later operator of the layer writes its output's storage in place."""
    mutates: bool = False
    """It writes an input in place (`relu_`, `div_`): torch bumps the version of its
    output only after the selective policy cached it, so the cache entry reads as changed."""
    reads: tuple[int | None, ...] = ()
    """Per tensor input: the ordinal of the layer's operator that last wrote its storage
    (None: none did, as for a parameter or the layer's input). The layer's dataflow."""
    out_shape: tuple[int, ...] = ()
    """The shape of its first tensor output (() when it has none)."""

    @property
    def cacheable(self) -> bool:
        """Whether torch's selective checkpoint can keep its output: torch refuses a cached
        tensor changed after caching, which both kinds of in-place writing cause."""
        return not (self.overwritten or self.mutates)


@dataclass(frozen=True)
class LayerOps:
    """A layer's forward as the selective policy sees it."""

    ops: tuple[OpCost, ...]
    """Every operator the policy sees, in order (its ordinal is its index)."""
    producers: tuple[int | None, ...]
    """Per saved tensor (the layer's saving order, parameters excluded): the ordinal of
    the operator that last wrote its storage in this forward; None when none did."""
    last_op: int
    """The ordinal of the operator during which the last tensor was saved (-1: none):
    the recompute replays up to it."""
    saved_bytes: tuple[int, ...] = ()
    """Per saved tensor: its storage's bytes, 0 when an earlier saved tensor had the storage."""
    output_op: int | None = None
    """The operator that last wrote the layer's output storage (None: none of its own)."""
    saved_shapes: tuple[tuple[int, ...], ...] = ()
    """Per saved tensor: its shape (as `producers`)."""
    input_shape: tuple[int, ...] = ()
    """The shape of the layer's first tensor argument (its hidden states)."""

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The operators' names in order (what the policy checks the forward against)."""
        return tuple(op.name for op in self.ops)

    def recomputable(self) -> list[int]:
        """Positions of the saved tensors an operator of the layer produced."""
        return [p for p, op in enumerate(self.producers) if op is not None]


def storage_id(t: torch.Tensor) -> int:
    """Identity of `t`'s storage on any tensor (real, meta or fake, whose `data_ptr()` is
    0): the storage object's address, valid while the storage lives (callers keep what
    they compare alive)."""
    return t.untyped_storage()._cdata


def _nbytes(values: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in values)


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, alias: bool,
            reads: tuple[int | None, ...] = ()) -> OpCost:
    """What re-running `func(*args, **kwargs)` (which returned `out`; `alias`: a view of
    its input; `reads`: `OpCost.reads`) costs."""
    formula = flop_formula(func._overloadpacket)  # torch's, and the CPU SDPA kernel's it lacks
    flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
    out_bytes = 0 if alias else _nbytes(tensors_in(out))
    moved = 0 if alias else _nbytes(tensors_in((args, kwargs))) + out_bytes
    first = next(iter(tensors_in(out)), None)
    return OpCost(name=str(func), flops=flops, bytes_moved=moved, out_bytes=out_bytes,
                  random=torch.Tag.nondeterministic_seeded in func.tags, mutates=func._schema.is_mutable,
                  reads=reads, out_shape=tuple(first.shape) if first is not None else ())


class OpTrace(TorchDispatchMode):
    """Lists the operators of the forwards it watches, per layer (`begin` starts a
    layer's list, `end` stops listing), and which operator last wrote each storage (made
    it, or changed it in place; a view writes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpCost] = []
        self.active = False
        self._writer: dict[int, int] = {}
        self.last_saved_op = -1

    def begin(self) -> None:
        self.ops = []
        self._writer = {}
        self.last_saved_op = -1
        self.active = True

    def end(self) -> None:
        self.active = False

    def writer(self, t: torch.Tensor) -> int | None:
        """The ordinal of the operator of this layer that last wrote `t`'s storage."""
        return self._writer.get(storage_id(t))

    def producer(self, t: torch.Tensor) -> int | None:
        """The ordinal of the operator of this layer that last wrote `t`'s storage (and
        note that a tensor is being saved now)."""
        if not self.active:
            return None
        self.last_saved_op = len(self.ops) - 1
        return self._writer.get(storage_id(t))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active and func not in SAC_IGNORED_OPS:
            ordinal = len(self.ops)
            read = tensors_in((args, kwargs))
            inputs = {storage_id(t) for t in read}
            outputs = tensors_in(out)
            # a view's storage is its base's, and so is an out-of-place op's output that
            # aliases its input (`_unsafe_view`): they write nothing; in-place ops write
            alias = func.is_view or (not func._schema.is_mutable and all(storage_id(t) in inputs for t in outputs))
            reads = tuple(self._writer.get(storage_id(t)) for t in read)  # before this op's writes
            self.ops.append(op_cost(func, args, kwargs, out, alias, reads))
            if not alias:
                mutates = func._schema.is_mutable
                for t in outputs:
                    key = storage_id(t)
                    earlier = self._writer.get(key)
                    # written in place: the earlier writer's output changes (an operator that
                    # writes nothing in place made a new storage, perhaps at a freed one's address)
                    if mutates and earlier is not None:
                        self.ops[earlier] = replace(self.ops[earlier], overwritten=True)
                    self._writer[key] = ordinal
        return out


def _replayed_producers(ops: LayerOps, recomputed: Collection[int]) -> set[int]:
    return {o for p in recomputed if (o := ops.producers[p]) is not None}


def is_whole(ops: LayerOps, recomputed: Collection[int]) -> bool:
    """Whether recomputing `recomputed` recomputes every saved tensor a layer's operator
    produced: the whole layer is checkpointed, nothing cached."""
    return all(p in recomputed for p in ops.recomputable())


CACHE_FLOPS_PER_BYTE = 256
"""A matrix product is cached when replaying it would cost at least this many FLOPs per
byte its output holds: about a GPU's machine balance (V100 139, A100 200, H100 295 FLOP
per HBM byte), so what is cheaper is replayed like a memory-bound operator. Projections
(2h FLOPs per output element) are cached; attention scores (2 x head size per element,
and B x heads x T^2 of them) are replayed, as Megatron's selective recompute does."""


def worth_caching(op: OpCost) -> bool:
    """Whether a product's output is cached rather than replayed (`CACHE_FLOPS_PER_BYTE`)."""
    return op.flops > 0 and op.flops >= CACHE_FLOPS_PER_BYTE * op.out_bytes


def cached_ops(ops: LayerOps, recomputed: Collection[int]) -> frozenset[int]:
    """Ordinals of the operators whose outputs the forward caches when the plan recomputes
    the saved tensors `recomputed`; empty for the whole layer (`is_whole`). Cached: the
    producer of every other saved tensor and every matrix product worth caching
    (`worth_caching`) that produces no recomputed tensor (such a product is not replayed
    to rebuild cheap tensors: its output is kept instead, which makes selective recompute
    cheap); the random operators all
    together, when none of them is replayed and each can be cached. Never cached: an
    operator writing in place or whose output a later one writes in place (torch
    refuses such a cache entry: `OpCost.cacheable`) and one after the replay's end (its
    entry would never be used)."""
    if is_whole(ops, recomputed):
        return frozenset()
    replayed = _replayed_producers(ops, recomputed)
    random = {o for o, op in enumerate(ops.ops) if op.random}
    cached = {o for p, o in enumerate(ops.producers) if o is not None and o not in replayed}
    cached |= {o for o, op in enumerate(ops.ops) if worth_caching(op) and o not in replayed}
    if replayed & random or not all(ops.ops[o].cacheable for o in random):
        cached -= random  # the random stream is replayed whole, or not at all
    else:
        cached |= random
    return frozenset(o for o in cached if o <= ops.last_op and ops.ops[o].cacheable)


def closed_set(ops: LayerOps, recomputed: Collection[int]) -> frozenset[int]:
    """The saved tensors (positions) really recomputed when a plan recomputes
    `recomputed`: every one whose producer the forward does not cache (`cached_ops`)."""
    if is_whole(ops, recomputed):
        return frozenset(ops.recomputable())
    cached = cached_ops(ops, recomputed)
    return frozenset(p for p, o in enumerate(ops.producers) if o is not None and o not in cached)


def check_closed(ops: LayerOps, recomputed: Collection[int], names: Sequence[str], where: str) -> frozenset[int]:
    """`closed_set`, or `PlanError` naming (in `where`) a tensor the plan keeps that
    recomputing the others would recompute too."""
    closed = closed_set(ops, recomputed)
    extra = sorted(closed - set(recomputed))
    if extra:
        op = ops.ops[ops.producers[extra[0]]]  # type: ignore[index]
        why = ("random operators are replayed all together" if op.random else
               "torch cannot cache what is written in place" if not op.cacheable else "it is replayed with the others")
        raise PlanError(f"{where}: the recompute the plan asks for also recomputes {names[extra[0]]}, which it "
                        f"keeps ({op.name}: {why}); recompute it too")
    return closed


def _of_activations(op: OpCost) -> bool:
    """A matrix product of two tensors the layer computed (q @ k^T, probs @ v), not a
    projection (one operand a parameter, which no operator of the layer wrote)."""
    return op.flops > 0 and bool(op.reads) and all(r is not None for r in op.reads)


def _core_ops(ops: LayerOps, scores: int) -> set[int]:
    """The operators between the product `scores` (q @ k^T) and the products of
    activations its output reaches through operators that are no matrix product (probs @
    v): those downstream of `scores` and upstream of such a product, by the trace's
    dataflow (`OpCost.reads`). Empty when its output reaches no such product."""
    reached = {scores}  # reached from `scores` through operators that are no matrix product
    ends: list[int] = []  # the products of activations reached (probs @ v)
    for o in range(scores + 1, len(ops.ops)):
        op = ops.ops[o]
        if not any(r in reached for r in op.reads):
            continue
        if op.flops == 0:
            reached.add(o)
        elif _of_activations(op):
            ends.append(o)
    core: set[int] = set()
    stack = [r for o in ends for r in ops.ops[o].reads if r in reached and r != scores]
    while stack:  # back from probs @ v, staying within what `scores` reaches
        o = stack.pop()
        if o not in core:
            core.add(o)
            stack += [r for r in ops.ops[o].reads if r in reached and r != scores]
    return core


def attention_core(ops: LayerOps) -> frozenset[int]:
    """The saved tensors (positions) of the layer's attention core as Megatron-LM's selective
    recompute drops them (Korthikanti et al. 2022, section 4.1: the softmax output, the
    attention dropout's mask and output, 5as/h of the layer's sbh(34 + 5as/h) bytes): those
    produced by the operators between q @ k^T and probs @ v (`_core_ops`), where q @ k^T is
    a product of two activations (`_of_activations`) whose output's two last dimensions are
    both a sequence length (a dimension of the layer's input other than its last, the
    hidden size). Told by where the operators sit, not by the saved tensors' shapes, which
    can look alike: q, k, v's copies are (b a, s, h/a), s x s when s = h/a, and the dropout
    masks of the block (b, s, h) are s x s when s = h. Empty for a layer that saves none
    (SDPA/flash attention, an MLP)."""
    lengths = {d for d in ops.input_shape[:-1] if d > 1}
    core: set[int] = set()
    for o, op in enumerate(ops.ops):
        shape = op.out_shape
        if _of_activations(op) and len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] in lengths:
            core |= _core_ops(ops, o)
    return frozenset(p for p, o in enumerate(ops.producers) if o in core)


def attention_core_set(ops: LayerOps) -> frozenset[int]:
    """The closed set (`closed_set`) recomputing the attention core (`attention_core`): what
    the checkpoint really recomputes when a plan drops it; empty when the layer has no such
    core or the closed set is the whole layer."""
    core = attention_core(ops)
    closed = closed_set(ops, core) if core else frozenset()
    return frozenset() if is_whole(ops, closed) else closed


def recompute_menu(ops: LayerOps, limit: int = 3) -> list[frozenset[int]]:
    """The selective recompute choices a profile offers for one layer (each a closed set
    of saved-tensor positions, short of the whole layer), by bytes freed: the saved
    tensors of each producer that is no matrix product form a group; groups are added in
    order of bytes moved per byte freed, each prefix closed (`closed_set`), and of the
    distinct closed prefixes at most `limit` are kept, spread evenly, the last holding
    every group; besides them, the attention core's set (`attention_core_set`, Megatron-LM's
    selective recompute), when the layer has one."""
    groups: dict[int, set[int]] = {}
    for p, o in enumerate(ops.producers):
        if o is not None and ops.ops[o].flops == 0:
            groups.setdefault(o, set()).add(p)

    def cost_per_byte(o: int) -> float:
        return ops.ops[o].bytes_moved / (sum(ops.saved_bytes[p] for p in groups[o]) or 1)

    prefixes: list[frozenset[int]] = []
    current: frozenset[int] = frozenset()
    for o in sorted(groups, key=lambda k: (cost_per_byte(k), k)):
        current = closed_set(ops, current | groups[o])
        if current and not is_whole(ops, current) and current not in prefixes:
            prefixes.append(current)
    if len(prefixes) > limit:
        step = len(prefixes) / limit
        prefixes = [prefixes[min(len(prefixes) - 1, round((i + 1) * step) - 1)] for i in range(limit)]
    core = attention_core_set(ops)
    if core and core not in prefixes:
        prefixes = sorted([*prefixes, core], key=lambda c: sum(ops.saved_bytes[p] for p in c))
    return prefixes


def replay_cost(ops: LayerOps, cached: Collection[int]) -> tuple[float, int]:
    """(FLOPs, bytes moved) of the backward's replay under `cached`: every operator up to
    the one that saved the last tensor, less the cached ones."""
    flops, moved = 0.0, 0
    for o in range(ops.last_op + 1):
        if o not in cached:
            flops += ops.ops[o].flops
            moved += ops.ops[o].bytes_moved
    return flops, moved


def _policy(cached: frozenset[int], names: tuple[str, ...], counters: dict[bool, list[int]], ctx: Any, func: Any,
            *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    # One count per pass: torch <= 2.11 asks the policy again for every operator of the
    # recompute (`ctx.is_recompute` True, torch/utils/checkpoint.py's caching mode), which
    # replays the forward's operators from the first; 2.13 asks only during the forward
    # (pytorch/pytorch#176455). Either way the same ordinal gets the same answer.
    counter = counters[bool(getattr(ctx, "is_recompute", False))]
    ordinal = counter[0]
    counter[0] += 1
    if ordinal >= len(names) or str(func) != names[ordinal]:  # numbering by ordinal holds only then
        traced = names[ordinal] if ordinal < len(names) else "nothing"
        raise PlanError(f"the layer's forward ran {func} as its operator {ordinal} where its trace had {traced}: "
                        "it runs other operators than when it was traced (autocast, a data-dependent branch, "
                        "a hook), so what op-level recompute caches cannot be told apart")
    return CheckpointPolicy.MUST_SAVE if ordinal in cached else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts(cached: frozenset[int], names: tuple[str, ...]) -> tuple[Any, Any]:
    """torch's selective checkpoint contexts for one forward (and its recompute) of a
    layer that caches the operators `cached` (ordinals as `trace_layer_ops` counts them;
    `names`: the traced operators, which the forward must run in the same order)."""
    return create_selective_checkpoint_contexts(
        functools.partial(_policy, cached, names, {False: [0], True: [0]}))


def run_recomputed(forward: Any, ops: LayerOps | None, cached: frozenset[int] | None, *args: Any,
                   **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant checkpoint with the random state
    preserved: the whole layer is recomputed (`cached` None or empty), or all but the
    outputs of the operators `cached` of its trace `ops`."""
    if cached:
        assert ops is not None
        kwargs["context_fn"] = functools.partial(selective_contexts, cached, ops.names)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def trace_layer_ops(layer: torch.nn.Module, args: tuple[Any, ...], *, loss_fn: Any = None) -> LayerOps:
    """`LayerOps` of one forward of `layer` on `args` (with `loss_fn(output)` after it,
    outside the layer, as the last layer of a model runs). Saved tensors sharing a
    parameter's storage are not listed (they never move and are not counted)."""
    params = {storage_id(p) for p in layer.parameters()}
    trace = OpTrace()
    producers: list[int | None] = []
    sizes: list[int] = []
    shapes: list[tuple[int, ...]] = []
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_id(t)
        if key not in params:
            producers.append(trace.producer(t))
            shapes.append(tuple(t.shape))
            sizes.append(0 if key in seen else t.untyped_storage().nbytes())
            seen.add(key)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trace:
        trace.begin()
        out = layer(*args)
        trace.end()
        output_op = trace.writer(out) if isinstance(out, torch.Tensor) else None
        if loss_fn is not None:
            loss_fn(out)
    first = next(iter(tensors_in(args)), None)
    return LayerOps(ops=tuple(trace.ops), producers=tuple(producers), last_op=trace.last_saved_op,
                    saved_bytes=tuple(sizes), output_op=output_op, saved_shapes=tuple(shapes),
                    input_shape=tuple(first.shape) if first is not None else ())
