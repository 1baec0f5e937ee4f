"""A stage whose plan says `optimizer_step: host` (`StagePlan.optimizer_step`), as the static
half sees it: what the runtime runs (`runtime/optimizer_offload.py` HostOptimizerStep,
`runtime/master_weights.py` HOST_COPY) must be what the emulator simulates.

At run time such a stage keeps only its parameters and gradients on its device: the fp32
masters (host copies) and Adam's states live in pageable host memory for good, and each
layer's step copies its gradients device -> host through a pinned staging buffer in the
parameters' dtype, runs Adam on the CPU and copies the rounded parameters back, one
layer after the other on one stream. So the emulated device holds no optimizer bytes, the
stage's step is one `OPT:{s}:optim:LAYER` per layer whose tasks are the gradients' d2h
copy, the CPU step (`host_step_time.host_step_s`: torch's Adam one tensor at a time and
the runtime's copies around it) and the parameters' h2d copy, and what
it pins is the staging buffers, outside the plan's pinned pool.

gpt-tiny (bf16: fp32 masters) in 2 stages on cpu-local, whose host DRAM bandwidth (which
the CPU step is costed by) the tests state apart from the preset's (assumed as well).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpress.contract.actions import Kind, UnitId, UnitKind
from mpress.errors import PlanError, UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.models.transformer import build_stage
from mpress.contract.plan import Plan, StagePlan, TensorRule, hardware_fingerprint
from mpress.runtime import master_weights
from mpress.runtime.master_weights import MasterWeights
from mpress.static.emulate.channels import pcie_down, pcie_up
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.emulate.host_step_time import host_step_s
from mpress.static.emulate.breakdown import OPTIM, peak_breakdown
from mpress.static.plan.plan_eval import check_plan_for_setup, complete_plan
from mpress.static.plan.rewriter import (
    host_step_host_bytes,
    host_step_pinned_bytes,
    offloaded_optim_bytes,
)
from mpress.config.units import ALIGNMENT_BYTES, round_up
from tests.support.cuda_fakes import FakeCudart, as_if_cuda
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES

NUM_MICROBATCHES = 4
CPU_LOCAL = dataclasses.replace(load_hardware("cpu-local", num_devices=2, memory_bytes=1 << 30),
                                host_memory_gbps=20.0)
"""cpu-local with a host DRAM bandwidth (assumed: the stand-in's memcpy figure)."""
CFG = dataclasses.replace(load_model_config(MODEL), precision="bf16")
OFFLOAD = TensorRule(tensor="optim:*", technique="host")


def plan_and_eval(host_step: tuple[int, ...] = (), hardware=CPU_LOCAL, rules=None, schedule="1f1b"):
    """gpt-tiny's 2-stage plan on `hardware` with the step of `host_step` on the host,
    completed (program, pinned pools, peaks) and emulated as `mpress emulate` does."""
    setup = setup_pipeline(CFG, hardware, schedule=schedule, num_stages=2, microbatch_size=MICROBATCH_SIZE,
                           num_microbatches=NUM_MICROBATCHES, ranges=RANGES[2])
    stages = [StagePlan(stage=s, device=s, first_layer=a, end_layer=b, rules=list((rules or {}).get(s, [])),
                        optimizer_step="host" if s in host_step else "device")
              for s, (a, b) in enumerate(RANGES[2])]
    plan = Plan(strategy="test", model=CFG.name, model_fingerprint=CFG.fingerprint(), dtype=CFG.precision,
                profile_fingerprint="test",
                hardware=hardware.name, hardware_fingerprint=hardware_fingerprint(hardware), num_devices=2,
                device_memory_bytes=hardware.device.memory_bytes, schedule=schedule, num_stages=2, num_ranks=2,
                num_microbatches=NUM_MICROBATCHES, microbatch_size=MICROBATCH_SIZE, stage_to_device=[0, 1],
                stages=stages, fits=True)
    plan, ev = complete_plan(setup, plan)
    return setup, plan, ev


def host_tasks(ev, rank: int = 0):
    """The tasks of rank `rank`'s optimizer steps, with their start and end times."""
    tasks = ev.program.ranks[rank]
    starts, ends = ev.result.task_start_s[rank], ev.result.task_end_s[rank]
    first = next(i for i, t in enumerate(tasks) if t.action.kind is Kind.OPT)
    return [(t, starts[i], ends[i]) for i, t in enumerate(tasks) if i >= first]


# ---- memory on the device --------------------------------------------------------------------

def test_the_device_holds_no_optimizer_states_or_masters():
    setup, device_plan, dev = plan_and_eval()
    _s, host_plan, host = plan_and_eval(host_step=(0,))
    c0 = setup.costs[0]
    off = c0.optim_bytes + c0.master_bytes
    assert off == 12 * (c0.param_bytes // 2)  # bf16: Adam's two fp32 states + the fp32 master
    # emulated: the device's peak is lower by exactly those bytes; the other device is unchanged
    assert dev.result.peak_bytes[0] - host.result.peak_bytes[0] == off
    assert host.result.peak_bytes[1] == dev.result.peak_bytes[1]
    assert host_plan.stages[0].predicted_peak_bytes == dev.result.peak_bytes[0] - off
    # the static bytes the iteration starts with, and the memory model's need
    assert dev.program.static_bytes[0] - host.program.static_bytes[0] == off
    assert offloaded_optim_bytes(host_plan, setup.costs) == [off, 0]
    m_dev, m_host = dev.setup.memory[0], host.setup.memory[0]
    assert (m_host.optim_bytes, m_host.master_bytes) == (0, 0)
    assert m_dev.total_bytes - m_host.total_bytes == off
    assert host.setup.memory[1] == dev.setup.memory[1]


def test_an_optim_rule_of_a_host_step_stage_changes_nothing():
    """The host step subsumes `optim:` host rules: the same program, peaks and pools."""
    _s, plain, a = plan_and_eval(host_step=(0,))
    _s, ruled, b = plan_and_eval(host_step=(0,), rules={0: [OFFLOAD]})
    assert ruled.actions == plain.actions
    assert b.result.peak_bytes == a.result.peak_bytes
    assert [sp.pinned_host_bytes for sp in ruled.stages] == [sp.pinned_host_bytes for sp in plain.stages] == [0, 0]


def test_the_breakdown_puts_no_optimizer_state_on_the_device():
    setup, _p, ev = plan_and_eval(host_step=(0,))
    parts = peak_breakdown(ev.result, setup.costs, weight_stashing=False)
    assert parts[0][OPTIM] == 0
    assert sum(parts[0].values()) == ev.result.peak_bytes[0]


# ---- the step: d2h gradients, CPU Adam, h2d parameters -------------------------------------------

def test_the_program_steps_layer_by_layer_and_moves_nothing_the_runtime_would_not():
    """One OPT per layer (the runtime steps a stage layer by layer either way); the copies
    run inside it (no OI/OO in the plan's program: nothing at run time issues them for a
    host-step stage)."""
    setup, plan, _ev = plan_and_eval(host_step=(0,))
    program = plan.program(0)
    layers = [x.name for x in setup.costs[0].layers]
    assert [str(a) for a in program if a.kind is Kind.OPT] == [f"0OPT:0:optim:{name}" for name in layers]
    assert not [a for a in program if a.kind in (Kind.OI, Kind.OO)]
    assert [str(a) for a in plan.program(1) if a.kind is Kind.OPT] == ["1OPT"]


def test_each_layer_copies_its_gradients_out_steps_on_the_cpu_and_copies_its_parameters_back():
    setup, _p, ev = plan_and_eval(host_step=(0,))
    layers = setup.costs[0].layers
    hw = CPU_LOCAL
    tasks = host_tasks(ev)
    outs = [(t, s, e) for t, s, e in tasks if t.action.kind is Kind.OO]
    cpus = [(t, s, e) for t, s, e in tasks if t.action.kind is Kind.OPT and t.compute_s > 0]
    ins = [(t, s, e) for t, s, e in tasks if t.action.kind is Kind.OI]
    assert len(outs) == len(cpus) == len(ins) == len(layers)
    for j, layer in enumerate(layers):
        (d2h, d2h_s, d2h_e), (cpu, cpu_s, cpu_e), (h2d, h2d_s, _h2d_e) = outs[j], cpus[j], ins[j]
        assert UnitId.parse(d2h.action.tensor) == UnitId(0, UnitKind.GRADS, layer=layer.name)
        assert UnitId.parse(h2d.action.tensor) == UnitId(0, UnitKind.PARAMS, layer=layer.name)
        assert cpu.action.tensor == f"0:optim:{layer.name}"
        # the gradients (parameters' dtype) up the stage's PCIe uplink, the parameters down it
        assert {(x.channel, x.bytes) for x in d2h.transfers} >= {(pcie_up(hw, 0), layer.grad_bytes)}
        assert {(x.channel, x.bytes) for x in h2d.transfers} >= {(pcie_down(hw, 0), layer.param_bytes)}
        assert d2h.alloc_bytes == h2d.alloc_bytes == 0  # staged through host buffers; in place on the device
        # Adam on the CPU, with nothing of it on the device; the layer's gradients go when it ends
        assert cpu.compute_s == pytest.approx(host_step_s(layer.optim_bytes // 8, layer.param_bytes, hw, 1))
        assert (cpu.transient_bytes, cpu.free_bytes) == (0, layer.grad_bytes)
        # one stream, in order: gradients out, the step, parameters back, then the next layer
        assert d2h_e <= cpu_s and cpu_e <= h2d_s
        if j:
            assert ins[j - 1][2] <= d2h_s
    # the iteration ends when the last parameters are back
    assert ev.result.iteration_s == pytest.approx(max(ev.result.task_end_s[0] + ev.result.task_end_s[1]))
    assert ins[-1][2] == pytest.approx(ev.result.iteration_s)


def test_the_iteration_grows_with_the_copies_when_pcie_halves():
    slow = dataclasses.replace(CPU_LOCAL, pcie_h2d_gbps=CPU_LOCAL.pcie_h2d_gbps / 2,
                               pcie_d2h_gbps=CPU_LOCAL.pcie_d2h_gbps / 2)
    setup, _p, dev = plan_and_eval()
    _s, _p, dev_slow = plan_and_eval(hardware=slow)
    _s, _p, host = plan_and_eval(host_step=(0,))
    _s, _p, host_slow = plan_and_eval(host_step=(0,), hardware=slow)
    assert dev_slow.result.iteration_s == pytest.approx(dev.result.iteration_s)  # nothing crosses PCIe
    moved = sum(x.grad_bytes + x.param_bytes for x in setup.costs[0].layers)
    # serial copies, each taking twice as long: the step's tail grows by what they took
    grown = moved / (CPU_LOCAL.pcie_gbps("d2h") * 1e9)
    assert host_slow.result.iteration_s - host.result.iteration_s == pytest.approx(grown, rel=1e-6)
    # and the CPU step is on the path: the host step is slower than the device's here
    cpu_s = host_step_s(setup.costs[0].optim_bytes // 8, setup.costs[0].param_bytes, CPU_LOCAL)
    assert host.result.iteration_s > dev.result.iteration_s
    assert sum(t.compute_s for t, _s, _e in host_tasks(host)) == pytest.approx(cpu_s)


def test_stages_stepping_on_the_host_at_once_share_its_memory_bandwidth():
    setup, _p, one = plan_and_eval(host_step=(0,))
    _s, _p, both = plan_and_eval(host_step=(0, 1))
    n0, b0 = setup.costs[0].optim_bytes // 8, setup.costs[0].param_bytes
    assert sum(t.compute_s for t, _s, _e in host_tasks(one)) == pytest.approx(host_step_s(n0, b0, CPU_LOCAL, 1))
    assert sum(t.compute_s for t, _s, _e in host_tasks(both)) == pytest.approx(host_step_s(n0, b0, CPU_LOCAL, 2))


def test_a_host_step_on_hardware_without_a_host_memory_bandwidth_is_refused_in_one_line():
    """A server `mpress topo` detects states no host DRAM bandwidth, which times the CPU
    step: a plan stepping on the host there cannot be emulated (it would cost the step
    nothing), so it is refused naming the stage, the hardware and the key."""
    unknown = dataclasses.replace(CPU_LOCAL, name="detected", host_memory_gbps=None)
    with pytest.raises(UserError, match=r"stages\[0\]\.optimizer_step.*detected.*host_memory_gbps") as err:
        plan_and_eval(host_step=(0,), hardware=unknown)
    assert "\n" not in str(err.value)
    plan_and_eval(hardware=unknown)  # a plan stepping on its devices does not need it


def test_cpu_local_as_shipped_times_the_host_step():
    """cpu-local states an assumed host DRAM bandwidth, so its host-step plans emulate."""
    shipped = load_hardware("cpu-local", num_devices=2, memory_bytes=1 << 30)
    assert shipped.host_memory_gbps is not None
    setup, _p, ev = plan_and_eval(host_step=(0,), hardware=shipped)
    cpu_s = host_step_s(setup.costs[0].optim_bytes // 8, setup.costs[0].param_bytes, shipped)
    assert cpu_s > 0
    assert sum(t.compute_s for t, _s, _e in host_tasks(ev)) == pytest.approx(cpu_s)


# ---- host memory: what the runtime pins and what it keeps pageable --------------------------------

@pytest.fixture
def pinning(monkeypatch):
    """What a run on a GPU page-locks, here without CUDA: every `cudaHostRegister` (a fake
    CUDA runtime records it) and every buffer asked of torch's pinned allocator
    (`torch.empty(..., pin_memory=True)`, made unpinned), by bytes."""
    cudart = FakeCudart()
    torch_pinned: list[int] = []
    real_empty = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):
        t = real_empty(*args, **kwargs)
        if pin_memory:
            torch_pinned.append(t.untyped_storage().nbytes())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(master_weights, "_on_accelerator", lambda p: True)  # as on a GPU
    as_if_cuda(monkeypatch, cudart)
    return cudart, torch_pinned


def test_pinned_and_pageable_host_bytes_are_what_the_runtime_allocates(pinning):
    cudart, torch_pinned = pinning
    setup, plan, _ev = plan_and_eval(host_step=(0,))
    pinned, pageable = host_step_pinned_bytes(plan, setup.costs), host_step_host_bytes(plan, setup.costs)
    assert pinned[1] == pageable[1] == 0  # the device stage keeps its optimizer on its device
    # the runtime: stage 0's parameters stepped on the host (the trainer's MasterWeights)
    module = build_stage(CFG, *RANGES[2][0], seed=0)
    params = dict(module.named_parameters())
    mw = MasterWeights(params, lambda ts: torch.optim.Adam(ts), host=list(params), slabs=[list(params)])
    # one slab for the stage's staging buffers (parameters' dtype), pinned in place to the
    # pool's alignment, not per buffer through torch's power-of-two pinned allocator
    assert torch_pinned == []
    assert list(cudart.registered.values()) == [pinned[0]]
    assert pinned[0] == round_up(setup.costs[0].param_bytes, ALIGNMENT_BYTES)
    for name in params:  # Adam makes its states at its first step (on the host copies)
        mw.target(name).grad = torch.zeros_like(mw.target(name))
    mw.optimizer.step()
    host = 0
    for name in params:
        target = mw.target(name)
        host += target.untyped_storage().nbytes()
        host += sum(s.untyped_storage().nbytes() for s in mw.optimizer.state[target].values() if s.dim() > 0)
    assert pageable[0] == host
    # the plan's pool is only what its swaps need: the staging buffers are pinned apart
    assert plan.stages[0].pinned_host_bytes == 0
    mw.close()
    assert cudart.registered == {}


def test_two_host_step_stages_pin_a_slab_each():
    setup, plan, _ev = plan_and_eval(host_step=(0, 1))
    assert host_step_pinned_bytes(plan, setup.costs) == [round_up(c.param_bytes, ALIGNMENT_BYTES)
                                                        for c in setup.costs]


def test_the_plan_check_counts_the_host_steps_host_memory():
    """Pools and staging buffers within what the server can pin; those and the pageable
    copies and states within its host memory (`check_plan_for_setup`, as `mpress emulate`
    and training start-up check a plan)."""
    setup, plan, _ev = plan_and_eval(host_step=(0,))
    check_plan_for_setup(plan, setup)
    staging = host_step_pinned_bytes(plan, setup.costs)[0]
    pageable = host_step_host_bytes(plan, setup.costs)[0]
    for hw, says in [(dataclasses.replace(CPU_LOCAL, pinnable_host_bytes=staging - 1), "can pin"),
                     (dataclasses.replace(CPU_LOCAL, host_memory_bytes=staging + pageable - 1), "host memory")]:
        tight = dataclasses.replace(setup, hardware=hw)
        with pytest.raises(PlanError, match=rf"stages\[0\]\.optimizer_step: .*{says}") as err:
            check_plan_for_setup(dataclasses.replace(plan, hardware_fingerprint=hardware_fingerprint(hw)), tight)
        assert "\n" not in str(err.value)
    roomy = dataclasses.replace(CPU_LOCAL, pinnable_host_bytes=staging, host_memory_bytes=staging + pageable)
    check_plan_for_setup(dataclasses.replace(plan, hardware_fingerprint=hardware_fingerprint(roomy)),
                         dataclasses.replace(setup, hardware=roomy))
