"""What one emulated iteration produced: times, memory, stalls and the spans of every
task (`emulator.py` describes what is simulated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from mpress.contract.actions import Kind
from mpress.static.emulate.program import Cost, Program


class TaskSpan(NamedTuple):
    """When one task (or send) ran. lane: "compute", "drop", or the "+"-joined channel ids
    of its transfers ("" for a copy without transfers)."""

    action: str
    start_s: float
    end_s: float
    lane: str


@dataclass(frozen=True, kw_only=True)
class EmulatorResult:
    """Outcome of one emulated iteration. Per-device tuples are indexed by device, per-rank
    tuples by rank."""

    iteration_s: float
    """Time from the start to the end of the last task, copy or send."""
    samples_per_s: float
    model_tflops: float
    """Model FLOPs (without recompute) per second, in 1e12."""
    peak_bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    oom: tuple[bool, ...]
    """peak_bytes > capacity_bytes, per device."""
    timeline: tuple[tuple[tuple[float, int], ...], ...]
    """Per device: (time_s, bytes in use) after every change, in time order (several
    points may share a time); the first point is (0.0, static bytes)."""
    stall_s_by_tensor: dict[str, float]
    """Compute-stream stall blamed on each tensor's copy-ins."""
    stall_s_by_cost: dict[Cost, float]
    """Stall per cost of the task blamed (the copy's technique), `pipeline` for bubbles."""
    stall_s_by_rank: tuple[float, ...]
    busy_s_by_rank: tuple[float, ...]
    """Sum of compute_s of the rank's compute tasks."""
    busy_s_by_cost: dict[Cost, float]
    """Compute time per cost of the compute tasks (`recompute` is RC overhead)."""
    task_start_s: tuple[tuple[float, ...], ...]
    """Per rank, start of each task of `program.ranks[rank]`, in list order."""
    task_end_s: tuple[tuple[float, ...], ...]
    send_spans: tuple[tuple[TaskSpan, ...], ...]
    """Per rank, the activation and gradient sends it started ("send:0F3->1", "send:1B3->0")."""
    program: Program = field(repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """No device ran out of memory."""
        return not any(self.oom)

    @property
    def stall_s(self) -> float:
        """Total stall over all ranks."""
        return sum(self.stall_s_by_rank)

    @property
    def rank_device(self) -> tuple[int, ...]:
        return self.program.rank_device

    def summary(self) -> dict[str, object]:
        """Headline figures as plain data (for YAML/JSON reports), without spans or timelines."""
        return {
            "iteration_s": self.iteration_s, "samples_per_s": self.samples_per_s,
            "model_tflops": self.model_tflops, "fits": self.fits,
            "peak_bytes": list(self.peak_bytes), "capacity_bytes": list(self.capacity_bytes),
            "oom": list(self.oom), "stall_s_by_rank": list(self.stall_s_by_rank),
            "busy_s_by_rank": list(self.busy_s_by_rank),
            "stall_s_by_cost": {str(k): v for k, v in self.stall_s_by_cost.items()},
            "stall_s_by_tensor": dict(self.stall_s_by_tensor),
            "busy_s_by_cost": {str(k): v for k, v in self.busy_s_by_cost.items()},
        }

    @cached_property
    def spans(self) -> tuple[tuple[TaskSpan, ...], ...]:
        """Per rank: its tasks in list order, then its sends (built on first use)."""
        out = []
        for r, tasks in enumerate(self.program.ranks):
            rank_spans = [
                TaskSpan(t.label(), s, e,
                         "compute" if t.action.is_compute else "drop" if t.action.kind is Kind.DR
                         else "+".join(x.channel for x in t.transfers))
                for t, s, e in zip(tasks, self.task_start_s[r], self.task_end_s[r])
            ]
            out.append(tuple(rank_spans) + self.send_spans[r])
        return tuple(out)
