"""Op-level recompute in a profile: which operator produced each saved tensor, and the
layer's recompute choices with what each keeps and what its replay costs.

The memory probe (`memory_probe.probe`) traces a layer's forward and measures the
memory of each choice of `mpress.contract.selective.recompute_menu`, running the layer as the
runtime runs it; this module turns that into the profile's words (`SavedTensor.op*`,
`RecomputeOption`) and prices a replay with the hardware model: an operator takes the
longer of its matrix-product FLOPs over the device's rate (`analytic.flops_time_s`) and
its bytes read and written over the device's memory bandwidth (a roofline). Every
profiler (analytic, measured, fake) calls these, so the three agree by construction.

`ProbeSummary` is what a profile keeps of a probe, as plain data: the analytic profiler
stores it on disk (`analytic_probe`), so a profile is made from it without torch; every
profile's words go through it. Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from mpress.hardware.server import Hardware
from mpress.static.profile.profile import LayerMemory, RecomputeOption, SavedTensor

if TYPE_CHECKING:  # torch-bound: loaded only where a probe runs
    from mpress.contract.selective import LayerOps, OpCost
    from mpress.static.profile.memory_probe import Probed

Producer = tuple[str, int, float, int]
"""(operator name, its ordinal, its FLOPs, its bytes moved) of a saved tensor's producer."""


@dataclass(frozen=True)
class OptionSummary:
    """One op-level recompute choice of a probe, in plain data."""

    tensors: tuple[int, ...]
    """The saved-tensor positions it recomputes, ascending."""
    flops: float
    bytes_moved: int
    replayed: tuple[tuple[float, int], ...]
    """(FLOPs, bytes moved) of each operator its replay runs, in order (priced per device)."""
    memory: LayerMemory
    attention_core: bool


@dataclass(frozen=True)
class ProbeSummary:
    """What a profile keeps of one layer's probe (`memory_probe.Probed`)."""

    plain: LayerMemory
    recomputed: LayerMemory
    producers: tuple[Producer | None, ...]
    """Per saved tensor, in saving order: its producer, None when no operator made it."""
    options: tuple[OptionSummary, ...]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> ProbeSummary:
        return ProbeSummary(
            plain=LayerMemory(**d["plain"]), recomputed=LayerMemory(**d["recomputed"]),
            producers=tuple(None if p is None else (p[0], p[1], p[2], p[3]) for p in d["producers"]),
            options=tuple(OptionSummary(tensors=tuple(o["tensors"]), flops=o["flops"], bytes_moved=o["bytes_moved"],
                                        replayed=tuple((f, b) for f, b in o["replayed"]),
                                        memory=LayerMemory(**o["memory"]), attention_core=o["attention_core"])
                          for o in d["options"]))


def _time_s(flops: float, bytes_moved: int, hardware: Hardware, precision: str) -> float:
    compute = flops / (hardware.peak_flops(precision) * hardware.compute_efficiency)
    gbps = hardware.device.memory_gbps
    memory = bytes_moved / (gbps * 1e9) if gbps else 0.0
    return max(compute, memory)


def op_time_s(op: OpCost, hardware: Hardware, precision: str) -> float:
    """Seconds one operator takes on one of `hardware`'s devices in `precision`."""
    return _time_s(op.flops, op.bytes_moved, hardware, precision)


def _replayed(ops: LayerOps, cached: frozenset[int]) -> tuple[tuple[float, int], ...]:
    return tuple((ops.ops[o].flops, ops.ops[o].bytes_moved) for o in range(ops.last_op + 1) if o not in cached)


def _replay_s(replayed: Sequence[tuple[float, int]], hardware: Hardware, precision: str) -> float:
    return sum(_time_s(f, b, hardware, precision) for f, b in replayed)


def replay_time_s(ops: LayerOps, cached: frozenset[int], hardware: Hardware, precision: str) -> float:
    """Seconds the backward's replay of a layer takes when the operators `cached` are cached
    (`selective.replay_cost`'s operators, each priced by `op_time_s`)."""
    return _replay_s(_replayed(ops, cached), hardware, precision)


def _producers(ops: LayerOps) -> tuple[Producer | None, ...]:
    return tuple(None if o is None else (ops.ops[o].name, o, ops.ops[o].flops, ops.ops[o].bytes_moved)
                 for o in ops.producers)


def summarize(probed: Probed) -> ProbeSummary:
    """The plain-data summary of a probe: its memory, producers and recompute choices."""
    from mpress.contract.selective import attention_core_set, cached_ops, replay_cost

    core = attention_core_set(probed.ops)
    options = []
    for tensors, memory in probed.options:
        cached = cached_ops(probed.ops, tensors)
        flops, moved = replay_cost(probed.ops, cached)
        options.append(OptionSummary(tensors=tuple(sorted(tensors)), flops=flops, bytes_moved=moved,
                                     replayed=_replayed(probed.ops, cached), memory=memory,
                                     attention_core=bool(core) and tensors == core))
    return ProbeSummary(plain=probed.plain, recomputed=probed.recomputed, producers=_producers(probed.ops),
                        options=tuple(options))


def _attach(saved: Sequence[SavedTensor], producers: Sequence[Producer | None]) -> list[SavedTensor]:
    if len(saved) != len(producers):  # the trace did not see the profile's saved tensors one for one
        return list(saved)
    return [t if p is None else replace(t, op=p[0], op_index=p[1], op_flops=p[2], op_bytes=p[3])
            for t, p in zip(saved, producers)]


def with_producers(saved: Sequence[SavedTensor], ops: LayerOps | ProbeSummary) -> list[SavedTensor]:
    """`saved` with the operator that produced each (`SavedTensor.op`, `op_index`,
    `op_flops`, `op_bytes`); unchanged when the trace does not line up with `saved`."""
    return _attach(saved, ops.producers if isinstance(ops, ProbeSummary) else _producers(ops))


def recompute_options(saved: Sequence[SavedTensor], probed: Probed | ProbeSummary, hardware: Hardware,
                      precision: str) -> list[RecomputeOption]:
    """The layer's op-level recompute choices as the profile states them (none when the
    trace does not line up with `saved`)."""
    summary = probed if isinstance(probed, ProbeSummary) else summarize(probed)
    if len(saved) != len(summary.producers):
        return []
    return [RecomputeOption(tensors=list(o.tensors), flops=o.flops, bytes_moved=o.bytes_moved,
                            time_s=_replay_s(o.replayed, hardware, precision), memory=o.memory,
                            attention_core=o.attention_core)
            for o in summary.options]
