"""The planner's drive step (`mpress/static/plan/planner_nvme.py`) and the drive's cost in
the emulator: on a 2-device stand-in whose devices cannot hold a widened gpt-tiny's
optimizer data, mpress sends it to the pinned pool; when the host may pin less than that
needs, the data goes to the local drive instead, the largest stage's first and no more
than the pins need, within the drive's capacity, each drive copy costed at the drive's
bandwidth, and each stage on the drive pins its store's staging buffers
(`NVME_STAGING_BYTES` each way: the model is wide enough that a stage's pool is larger)."""

from __future__ import annotations

import dataclasses

from mpress.config.model_config import load_model_config
from mpress.contract.plan_check import NVME_STAGING_BYTES
from mpress.contract.plan import Plan
from mpress.hardware.server import Hardware, load_hardware
from mpress.static.emulate.channels import NVME_READ, NVME_WRITE
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.plan.plan_eval import plan_from_rules
from mpress.static.studies.maxsize import Bound, plan_bound
from tests.support.documented import run_documented
from tests.support.plans import drive_hardware

MODEL = dataclasses.replace(load_model_config("gpt-tiny"), hidden_size=192, num_layers=12)
"""gpt-tiny widened and deepened until a stage's optimizer data (about 22 MB) outweighs the
drive store's two staging buffers (16.8 MB), so that the drive can lower the pins."""
DEVICE_BYTES = 36_000_000
"""`MODEL` in 2 stages, 4 microbatches of 2, fits this only with both stages' optimizer
data off the device (recompute alone is not enough)."""
STAGING = 2 * NVME_STAGING_BYTES
"""What a stage on the drive pins: its store's staging buffers, one each way."""


def _hardware(tmp_path, pinnable: int, device_bytes: int = DEVICE_BYTES, **drive: float) -> Hardware:
    """Host memory is what may be pinned: no pageable room for a host optimizer step
    (which would otherwise take the optimizer data off the pins instead of the drive)."""
    hw = load_hardware(drive_hardware(tmp_path), num_devices=2, memory_bytes=device_bytes)
    return dataclasses.replace(hw, pinnable_host_bytes=pinnable, host_memory_bytes=pinnable, **drive)


def _setup(hw: Hardware):
    return setup_pipeline(MODEL, hw, schedule="1f1b", num_stages=2, microbatch_size=2,
                          num_microbatches=4)


def _plan(hw: Hardware, drive: bool = True):
    setup = _setup(hw)
    return setup, plan_strategy(setup, "mpress", PlannerOptions(drive=drive))


def _optim(result) -> list[str]:
    return [next((str(r.technique) for r in sp.rules if r.tensor == "optim:*"), "keep") for sp in result.plan.stages]


def test_the_drive_takes_what_the_host_cannot_pin_largest_stage_first(tmp_path):
    roomy = _plan(_hardware(tmp_path, 8 * 10**9))[1]
    assert roomy.fits and _optim(roomy) == ["host", "host"]  # host memory is faster: no drive while pins fit
    need = roomy.host_bytes
    setup, host_only = _plan(_hardware(tmp_path, need - 1), drive=False)
    assert not host_only.fits and "pinnable host memory too small" in host_only.reason
    assert plan_bound(setup.hardware, host_only) is Bound.PINNED_HOST
    costs = setup.costs
    largest = max(range(2), key=lambda s: costs[s].optim_bytes + costs[s].master_bytes)
    one = _plan(_hardware(tmp_path, need - 1))[1]
    assert one.fits and one.host_bytes <= need - 1
    assert _optim(one)[largest] == "nvme" and _optim(one)[1 - largest] == "host"  # one stage was enough
    # what it pins: the pools and, apart, the drive store's staging buffers
    assert one.host_bytes == sum(sp.pinned_host_bytes for sp in one.plan.stages) + STAGING
    both = _plan(_hardware(tmp_path, one.host_bytes - 1))[1]
    assert both.fits and _optim(both) == ["nvme", "nvme"]
    assert both.host_bytes == sum(sp.pinned_host_bytes for sp in both.plan.stages) + 2 * STAGING
    assert one.evaluation.result.iteration_s > roomy.evaluation.result.iteration_s  # the drive is slower


def test_no_stage_goes_to_the_drive_where_its_staging_would_pin_more(tmp_path):
    """gpt-tiny's stages pin less for their optimizer data than a drive store's staging
    buffers: moving them would raise the pins, so they stay, and the plan says the pins
    are the bound (2.4 MB devices hold gpt-tiny only with its optimizer data off them)."""
    hw = _hardware(tmp_path, 1, device_bytes=2_400_000)
    setup = setup_pipeline(load_model_config("gpt-tiny"), hw, schedule="1f1b", num_stages=2, microbatch_size=2,
                           num_microbatches=4)
    assert all(c.optim_bytes + c.master_bytes < STAGING for c in setup.costs)
    result = plan_strategy(setup, "mpress", PlannerOptions())
    assert not result.fits and "nvme" not in _optim(result)
    assert "pinnable host memory too small" in result.reason


def test_what_the_drive_cannot_hold_stays_and_bounds_the_size(tmp_path):
    setup, result = _plan(_hardware(tmp_path, 1, nvme_bytes=1000))
    assert not result.fits and _optim(result) == ["host", "host"]
    assert plan_bound(setup.hardware, result) is Bound.DRIVES


def test_drive_copies_cross_the_drive_channels_at_its_bandwidth(tmp_path):
    """The same nvme plan emulated on a drive half as fast: each OO/OI of a chunk puts
    its bytes on the drive's channel of its direction, and the iteration gets longer."""
    setup, result = _plan(_hardware(tmp_path, 2 * STAGING))  # room for the staging buffers alone: both go
    assert _optim(result) == ["nvme", "nvme"]
    drive_bytes = sum(c.optim_bytes + c.master_bytes for c in setup.costs)
    moved = {NVME_WRITE: 0, NVME_READ: 0}
    for tasks in result.evaluation.program.ranks:
        for task in tasks:
            for transfer in task.transfers:
                if transfer.channel in moved:
                    moved[transfer.channel] += transfer.bytes
    assert moved == {NVME_WRITE: drive_bytes, NVME_READ: drive_bytes}
    slow_setup = _setup(_hardware(tmp_path, 2 * STAGING, nvme_read_gbps=0.05, nvme_write_gbps=0.025))
    slow = plan_from_rules(slow_setup, result.plan)
    assert slow.predicted_iteration_s > result.plan.predicted_iteration_s


def test_maxsize_refuses_mpress_nvme_without_drives_in_one_line():
    code, _out, err = run_documented(["maxsize", "--model", "gpt", "--hardware", "cpu-local", "--strategy",
                                      "mpress-nvme"], in_process=True)
    assert code == 2
    assert err.strip().splitlines() == [
        "mpress maxsize: error: mpress-nvme: hardware cpu-local states no local drive (nvme_bytes, nvme_read_gbps)"]


def test_a_plan_the_planner_put_on_the_drive_round_trips(tmp_path):
    result = _plan(_hardware(tmp_path, 1))[1]
    result.plan.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == result.plan
