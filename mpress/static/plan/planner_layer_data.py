"""The planner's last resort for a stage that compacting activations and optimizer data
cannot fit (`mpress` strategy): first step the stage's optimizer on the host
(`optimizer_step: host`: its states and masters leave the device for good, the step's
temporaries and streamed chunks with them), then keep layers' working parameters and
gradients in pinned host memory (`param:LAYER`, `grad:LAYER` host rules,
`layer_data.py`, which need that host step).

Per layer, two candidates, each weighed by the time its traffic cannot hide per byte it
frees at the stage's peak:

- parameters: free the layer's parameter bytes; move them host -> device twice per
  microbatch (forward and backward), each fetch overlapping the compute of the layer
  before it in the pass, so what the layer's forward and backward do not cover is exposed;
- gradients: free the layer's gradient bytes; move them device -> host once per
  microbatch, overlapping the layer's next backward steps.

The link time is the hardware's PCIe bandwidth, shared by the GPUs behind the stage's
switch that copy (`_Planner._pcie_sharing`). Candidates are taken cheapest first (ties:
the larger first) until the bytes still to shed are shed; the fit loop then emulates and
sheds again what the emulation still finds over. Hardware that states no host DRAM
bandwidth cannot time a host step, and weight stashing and split backwards are not
covered (`layer_data.py`): no candidate there.

Units: bytes, seconds.
"""

from __future__ import annotations

from typing import Any

from mpress.config.units import fmt_bytes
from mpress.contract.actions import Schedule
from mpress.contract.plan import Plan
from mpress.contract.plan_check import PINNED, HostBytes, host_bytes
from mpress.hardware.server import Hardware
from mpress.static.emulate.lowering import optimizer_transient_bytes
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.plan.layer_data import schedule_allows
from mpress.static.plan.plan_draft import KEEP, Draft
from mpress.static.plan.rewriter import OPTIMIZER_PREFETCH_DEPTH, host_step_bytes


def layer_data_candidates(costs: StageCosts, hardware: Hardware, num_microbatches: int, sharing: int,
                          taken_params: set[int], taken_grads: set[int]) -> list[tuple[float, int, str, int]]:
    """(exposed seconds per byte freed, -bytes freed, "param" | "grad", layer index) for
    each layer of the stage whose parameters or gradients still stay on the device."""
    h2d = hardware.pcie_gbps("h2d") * 1e9 / max(sharing, 1)
    d2h = hardware.pcie_gbps("d2h") * 1e9 / max(sharing, 1)
    m = num_microbatches
    out: list[tuple[float, int, str, int]] = []
    for j, layer in enumerate(costs.layers):
        previous = costs.layers[j - 1] if j else layer
        if j not in taken_params and layer.param_bytes:
            exposed = max(2 * m * layer.param_bytes / h2d - m * (previous.forward_time_s + layer.backward_time_s), 0)
            out.append((exposed / layer.param_bytes, -layer.param_bytes, "param", j))
        if j not in taken_grads and layer.grad_bytes:
            exposed = max(m * layer.grad_bytes / d2h - m * previous.backward_time_s, 0.0)
            out.append((exposed / layer.grad_bytes, -layer.grad_bytes, "grad", j))
    return sorted(out)


def plan_host_bytes(plan: Plan, costs: list[StageCosts]) -> HostBytes:
    """The host memory of `plan` in its parts (`mpress.contract.plan_check.host_bytes`),
    its host steps' bytes read from the stages' profile costs (`rewriter.host_step_bytes`):
    the one sum the planner, the plan check, the launcher's replicas and the studies read."""
    return host_bytes(plan, host_step_bytes(plan, costs))


def plan_pinned_bytes(plan: Plan, costs: list[StageCosts]) -> int:
    """Host memory `plan` pins over all stages: their pools, their host steps' slabs
    (`rewriter.host_step_pinned_bytes`; the second slab holds host parameters) and their
    drives' staging buffers (`plan_host_bytes`)."""
    return plan_host_bytes(plan, costs).pinned


def host_why(plan: Plan, costs: list[StageCosts], hardware: Hardware) -> str:
    """Why the server's host cannot hold what `plan` puts there, in one line ("": it can):
    what it pins (`plan_pinned_bytes`) within what the host can pin, and with the host
    steps' pageable fp32 copies and Adam states (`rewriter.host_step_host_bytes`) within
    its memory: the sum the plan check refuses a plan by (`mpress.contract.plan_check.host_bytes`)."""
    need = plan_host_bytes(plan, costs)
    exceeds = need.exceeds(hardware)
    if exceeds == PINNED:
        return (f"pinnable host memory too small for the host-swap volume: needs {fmt_bytes(need.pinned)}, "
                f"{hardware.name} can pin {fmt_bytes(hardware.pinnable_bytes)}")
    if exceeds is not None:
        return (f"host memory too small for the host optimizer steps: their fp32 copies and Adam states take "
                f"{fmt_bytes(need.pageable)} beside {fmt_bytes(need.pinned)} pinned, {hardware.name} has "
                f"{fmt_bytes(hardware.host_memory_bytes)}")
    return ""


class LayerDataSteps:
    """`_Planner`'s steps that move layers' parameters and gradients to the host."""

    hw: Hardware
    costs: list[StageCosts]
    num_mb: int
    sched: Schedule
    options: Any  # the planner's PlannerOptions

    def _pcie_sharing(self, s: int) -> int:  # implemented by the planner
        raise NotImplementedError

    def shed_layer_data(self, d: Draft, s: int, need: int) -> int:
        """Move layers of stage s's parameters / gradients to the host, cheapest first,
        until `need` bytes are shed; returns the bytes shed (0 where the hardware cannot
        time a host step, or under a schedule `layer_data.py` does not cover)."""
        if need <= 0 or self.hw.host_memory_gbps is None or not schedule_allows(self.sched):
            return 0
        c = self.costs[s]
        if not d.host_step[s]:  # what the step on the device holds: states, or the chunks it streams
            d.host_step[s] = True
            chunk = max(x.optimizer_data_bytes for x in c.layers)
            held = c.optimizer_data_bytes if d.optim[s] == KEEP else (OPTIMIZER_PREFETCH_DEPTH + 1) * chunk
            shed = held + max(optimizer_transient_bytes(x, self.hw) for x in c.layers)
            if shed >= need:
                return shed
        else:
            shed = 0
        if not self.options.layer_data:  # plans to train: the runtime does not run param:/grad: rules yet
            return shed
        for _score, neg_bytes, what, j in layer_data_candidates(c, self.hw, self.num_mb,
                                                                self._pcie_sharing(s), d.params[s], d.grads[s]):
            if shed >= need:
                break
            (d.params if what == "param" else d.grads)[s].add(j)
            shed += -neg_bytes
        return shed
