"""The ZeRO-Offload / ZeRO-Infinity baselines (`mpress.static.baselines.zero`): memory accounting as
the ZeRO papers count it, capacity verdicts, and the time model's response to the
server's channels (pure)."""

from dataclasses import replace

import pytest

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.emulate.host_adam import host_adam_step_s
from mpress.static.baselines.zero import REDUCE_BUCKET_ELEMENTS, ZERO_VARIANTS, plan_zero, zero_variants


def _setup(model="gpt-5.3b", hardware="dgx1-v100", mb=2, m=16, hw=None):
    hw = hw or load_hardware(hardware)
    return setup_pipeline(load_model_config(model), hw, schedule="1f1b", num_stages=hw.num_devices,
                          microbatch_size=mb, num_microbatches=m)


def _params(setup):
    return sum(x.optim_bytes for x in setup.profile.layers) // 8


def test_variants_follow_the_hardware():
    assert zero_variants(load_hardware("dgx1-v100")) == ZERO_VARIANTS
    assert zero_variants(load_hardware("cpu-local")) == ("zero-offload", "zero-infinity")


def test_offload_device_holds_the_whole_fp16_model_and_host_the_step_and_its_pinned_buffers():
    s = _setup()
    r = plan_zero(s, "zero-offload")
    n = _params(s)
    assert r.fits, r.reason
    assert r.memory.param_bytes == sum(x.param_bytes for x in s.profile.layers) == 2 * n
    assert r.peak_bytes >= r.memory.param_bytes + r.memory.activation_bytes
    # fp32 master, Adam's two moments and fp32 gradients (4 + 8 + 4 B), + fp16 accumulation (2 micro-steps),
    # + the pinned fp16 copy of each partition the step casts into (param_buffer_of_bit16_for_cpu_offload_groups)
    assert r.host_bytes == 16 * n + 2 * n + 2 * n
    assert r.nvme_bytes == 0


def test_infinity_device_holds_a_layer_or_two_and_the_host_everything():
    s = _setup()
    r = plan_zero(s, "zero-infinity")
    n = _params(s)
    largest = max(x.param_bytes for x in s.profile.layers)
    assert r.memory.param_bytes == 2 * largest  # the layer running and the one prefetched
    assert r.peak_bytes < plan_zero(s, "zero-offload").peak_bytes
    # fp16 params + fp32 master + moments + fp32 grads (2 + 4 + 8 + 4 B), the pinned fp16 gradient partitions
    # (stage3.py's grad_partitions_flat_buffer, 2 B), and the checkpoints of all ranks
    assert r.host_bytes == 20 * n + r.host_checkpoint_bytes
    assert r.host_checkpoint_bytes > 0


def test_fp16_params_over_the_device_do_not_fit_offload_but_fit_infinity():
    s = _setup("gpt-20.4b")
    assert sum(x.param_bytes for x in s.profile.layers) > s.hardware.usable_memory_bytes
    off = plan_zero(s, "zero-offload")
    assert not off.fits and "fp16 parameters" in off.reason and "usable" in off.reason
    inf = plan_zero(s, "zero-infinity")
    assert inf.fits, inf.reason


def test_host_over_pinnable_does_not_fit_and_says_so():
    hw = load_hardware("dgx1-v100")
    s = _setup(hw=replace(hw, pinnable_host_bytes=50 << 30))  # 50 GiB < 20 B x 5.3e9
    r = plan_zero(s, "zero-infinity")
    assert not r.fits and "pinnable" in r.reason


def test_nvme_over_the_drives_does_not_fit_and_says_so():
    hw = load_hardware("dgx1-v100")
    s = _setup(hw=replace(hw, nvme_bytes=10 << 30))
    r = plan_zero(s, "zero-infinity-nvme")
    assert not r.fits and "nvme_bytes" in r.reason
    n = _params(s)
    # fp16 params, fp32 master and moments, and the fp32 gradients the boundary swaps out
    # (stage3.py _swap_out_offload_fp32_gradients -> the optimizer swapper's swap_out_gradients)
    assert r.nvme_bytes == 18 * n
    # the host keeps the gradient partitions in the model's dtype (grad_partitions_flat_buffer) and the checkpoints
    assert r.host_bytes == 2 * n + r.host_checkpoint_bytes


def test_halving_pcie_makes_infinity_slower():
    hw = load_hardware("dgx1-v100")
    slow = replace(hw, pcie_h2d_gbps=hw.pcie_h2d_gbps / 2, pcie_d2h_gbps=hw.pcie_d2h_gbps / 2)
    assert plan_zero(_setup(hw=slow), "zero-infinity").iteration_s > plan_zero(_setup(hw=hw), "zero-infinity").iteration_s


def test_slower_host_dram_makes_the_optimizer_step_slower():
    hw = load_hardware("dgx-a100")
    slow = replace(hw, host_memory_gbps=hw.host_memory_gbps / 4)
    fast_r, slow_r = plan_zero(_setup(hw=hw), "zero-offload"), plan_zero(_setup(hw=slow), "zero-offload")
    assert slow_r.times.optimizer_s > fast_r.times.optimizer_s > 0


@pytest.mark.parametrize("variant", ZERO_VARIANTS)
@pytest.mark.parametrize(("model", "hardware"), [("gpt-5.3b", "dgx1-v100"), ("bert-0.64b", "dgx-a100")])
def test_iteration_is_at_least_the_batch_compute_over_the_devices(variant, model, hardware):
    s = _setup(model, hardware)
    r = plan_zero(s, variant)
    per_sample_s = sum(x.forward_time_s + x.backward_time_s for x in s.profile.layers)  # one microbatch
    m, n = s.schedule.num_microbatches, s.hardware.num_devices
    assert r.iteration_s >= per_sample_s * m / n
    assert r.times.compute_s >= per_sample_s * m / n  # plus the checkpointed layers' recompute
    assert r.iteration_s == pytest.approx(r.times.forward_s + r.times.backward_s + r.times.optimizer_s
                                          + r.times.param_update_s)
    assert r.samples_per_s == pytest.approx(m * s.microbatch_size / r.iteration_s)


def test_nvme_slower_than_host_when_the_drives_are_slower_than_pcie():
    s = _setup(hardware="dgx1-v100")
    assert s.hardware.nvme_gbps("read") < s.hardware.pcie_gbps("h2d")
    assert plan_zero(s, "zero-infinity-nvme").iteration_s > plan_zero(s, "zero-infinity").iteration_s


def test_nvme_variant_needs_drives():
    with pytest.raises(UserError, match="nvme"):
        plan_zero(_setup(hardware="cpu-local", m=8), "zero-infinity-nvme")


def test_unknown_variant_is_one_line():
    with pytest.raises(UserError, match="zero-offload"):
        plan_zero(_setup(), "zero-2")


def test_a_server_without_host_bandwidth_cannot_time_the_cpu_optimizer():
    # a GPU server that states no host DRAM bandwidth (cpu-local's 2 GiB cannot hold DeepSpeed's buckets)
    hw = replace(load_hardware("dgx-a100"), host_memory_gbps=None)
    r = plan_zero(_setup("bert-0.64b", hw=hw), "zero-offload")
    assert not r.fits and "host_memory_gbps" in r.reason


def test_the_cpu_step_is_host_adams_over_each_ranks_share():
    s = _setup()
    n = s.hardware.num_devices
    r = plan_zero(s, "zero-offload")
    assert r.times.optimizer_s == pytest.approx(host_adam_step_s(-(-_params(s) // n), s.hardware, sharers=n))
    assert r.times.param_update_s > 0  # the cast partition's copy to its GPU and the all-gather


@pytest.mark.parametrize(("variant", "buckets"), [("zero-offload", 2), ("zero-infinity", 1)])
def test_gradient_buckets_are_deepspeeds_full_reduce_bucket_size_even_for_a_smaller_model(variant, buckets):
    # stage_1_and_2.py and stage3.py allocate torch.empty(reduce_bucket_size, dtype=model dtype) per bucket
    # (two under overlap_comm, stage 2), whatever the model's size
    s = _setup("bert-0.35b", "dgx-a100")
    assert _params(s) < REDUCE_BUCKET_ELEMENTS
    r = plan_zero(s, variant)
    assert r.memory.grad_bytes >= buckets * REDUCE_BUCKET_ELEMENTS * 2


def test_offload_gpu_staging_buffer_is_the_largest_parameter_in_the_model_dtype():
    # stage_1_and_2.py: temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel, dtype=self.dtype), fp16 here
    s = _setup()
    largest_numel = max(x.largest_param_bytes for x in s.profile.layers) // 4  # the profile counts it in fp32
    r = plan_zero(s, "zero-offload")
    assert r.memory.grad_bytes == 2 * REDUCE_BUCKET_ELEMENTS * 2 + largest_numel * 2


@pytest.mark.parametrize("hardware", ["dgx1-v100", "dgx-a100"])
def test_nvme_step_reads_states_and_gradients_then_writes_in_turn_not_overlapped(hardware):
    """DeepSpeed's default optimizer swapper (PartitionedOptimizerSwapper: offload_optimizer's
    pipeline_read and pipeline_write default False) reads a sub-group's fp32 parameters,
    moments and gradients, steps it, writes it back, then the next: the step is the drives'
    time plus the CPU's, not the longer of the two."""
    s = _setup(hardware=hardware)
    hw, n = s.hardware, _params(s)
    r = plan_zero(s, "zero-infinity-nvme")
    read = (4 + 8 + 4) * n  # fp32 master, moments, fp32 gradients
    write = (4 + 8) * n + 2 * n  # fp32 master and moments back, and the new fp16 parameters
    drives = read / (hw.nvme_gbps("read") * 1e9) + write / (hw.nvme_gbps("write") * 1e9)
    cpu = host_adam_step_s(-(-n // hw.num_devices), hw, sharers=hw.num_devices)
    assert r.times.optimizer_s >= drives + cpu


def test_nvme_boundary_writes_the_fp32_gradients_to_the_drives_during_the_backward():
    hw = load_hardware("dgx-a100")
    slow = replace(hw, nvme_write_gbps=hw.nvme_gbps("write") / 20)
    fast_r, slow_r = plan_zero(_setup(hw=hw), "zero-infinity-nvme"), plan_zero(_setup(hw=slow), "zero-infinity-nvme")
    assert slow_r.times.backward_s > fast_r.times.backward_s
    assert plan_zero(_setup(hw=slow), "zero-infinity").times.backward_s == plan_zero(_setup(hw=hw), "zero-infinity").times.backward_s
