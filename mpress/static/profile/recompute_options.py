"""Op-level recompute in a profile: which operator produced each saved tensor, and the
layer's recompute choices with what each keeps and what its replay costs.

The memory probe (`memory_probe.probe`) traces a layer's forward and measures the
memory of each choice of `mpress.contract.selective.recompute_menu`, running the layer as the
runtime runs it; this module turns that into the profile's words (`SavedTensor.op*`,
`RecomputeOption`) and prices a replay with the hardware model: an operator takes the
longer of its matrix-product FLOPs over the device's rate (`analytic.flops_time_s`) and
its bytes read and written over the device's memory bandwidth (a roofline). Every
profiler (analytic, measured, fake) calls these, so the three agree by construction.
Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mpress.hardware.server import Hardware
from mpress.contract.selective import LayerOps, OpCost, attention_core_set, cached_ops, replay_cost
from mpress.static.profile.memory_probe import Probed
from mpress.static.profile.profile import RecomputeOption, SavedTensor


def op_time_s(op: OpCost, hardware: Hardware, precision: str) -> float:
    """Seconds one operator takes on one of `hardware`'s devices in `precision`."""
    compute = op.flops / (hardware.peak_flops(precision) * hardware.compute_efficiency)
    gbps = hardware.device.memory_gbps
    memory = op.bytes_moved / (gbps * 1e9) if gbps else 0.0
    return max(compute, memory)


def replay_time_s(ops: LayerOps, cached: frozenset[int], hardware: Hardware, precision: str) -> float:
    """Seconds the backward's replay of a layer takes when the operators `cached` are cached
    (`selective.replay_cost`'s operators, each priced by `op_time_s`)."""
    return sum(op_time_s(ops.ops[o], hardware, precision) for o in range(ops.last_op + 1) if o not in cached)


def aligned(saved: Sequence[SavedTensor], ops: LayerOps) -> bool:
    """Whether the probe's trace saw the profile's saved tensors, one for one."""
    return len(saved) == len(ops.producers)


def with_producers(saved: Sequence[SavedTensor], ops: LayerOps) -> list[SavedTensor]:
    """`saved` with the operator that produced each (`SavedTensor.op`, `op_index`,
    `op_flops`, `op_bytes`); unchanged when the trace does not line up (`aligned`)."""
    if not aligned(saved, ops):
        return list(saved)
    out = []
    for t, o in zip(saved, ops.producers):
        if o is None:
            out.append(t)
            continue
        op = ops.ops[o]
        out.append(replace(t, op=op.name, op_index=o, op_flops=op.flops, op_bytes=op.bytes_moved))
    return out


def recompute_options(saved: Sequence[SavedTensor], probed: Probed, hardware: Hardware,
                      precision: str) -> list[RecomputeOption]:
    """The layer's op-level recompute choices as the profile states them (none when the
    trace does not line up with `saved`)."""
    if not aligned(saved, probed.ops):
        return []
    out = []
    core = attention_core_set(probed.ops)
    for tensors, memory in probed.options:
        cached = cached_ops(probed.ops, tensors)
        flops, moved = replay_cost(probed.ops, cached)
        out.append(RecomputeOption(tensors=sorted(tensors), flops=flops, bytes_moved=moved,
                                   time_s=replay_time_s(probed.ops, cached, hardware, precision), memory=memory,
                                   attention_core=bool(core) and tensors == core))
    return out
