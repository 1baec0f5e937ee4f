"""The launcher's control plane: object collectives go over the gloo control group (under
NCCL an object collective on the default group copies through the GPU and syncs it every
step), one collective binds each rank to its device before the pipeline's first
neighbour-only send/recv, and no two ranks train on one GPU."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mpress import train as train_module
from mpress.errors import PlanError, UserError
from mpress.launcher.devices import DeviceClaim, bind_device, check_distinct_devices
from mpress.runtime.train_config import TrainConfig


# -- no two ranks on one GPU (pure) -------------------------------------------------------------------
def test_distinct_gpus_pass() -> None:
    check_distinct_devices([DeviceClaim(rank=r, host="a", gpu=f"0000:0{r}:00.0") for r in range(4)])
    # the same bus id on another host is another GPU; CPU ranks share the host, not a GPU
    check_distinct_devices([DeviceClaim(rank=0, host="a", gpu="0000:06:00.0"),
                            DeviceClaim(rank=1, host="b", gpu="0000:06:00.0"),
                            DeviceClaim(rank=2, host="a", gpu=None), DeviceClaim(rank=3, host="a", gpu=None)])


def test_two_ranks_on_one_gpu_is_one_line_naming_both() -> None:
    claims = [DeviceClaim(rank=3, host="node1", gpu="0000:07:00.0"),
              DeviceClaim(rank=0, host="node1", gpu="0000:06:00.0"),
              DeviceClaim(rank=1, host="node1", gpu="0000:07:00.0")]
    with pytest.raises(PlanError) as err:
        check_distinct_devices(claims)
    assert str(err.value).startswith("ranks 1 and 3 both train on GPU 0000:07:00.0 of node1; ")
    assert "\n" not in str(err.value)


# -- binding a rank to its device ----------------------------------------------------------------------
def test_bind_device_sets_the_device_then_runs_one_collective_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch, "zeros", lambda n, device: ("a tensor on", torch.device(device)))  # no GPU here
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(("all_reduce", t)))
    bind_device(torch.device("cuda", 3))
    assert calls == [("set_device", torch.device("cuda", 3)), ("all_reduce", ("a tensor on", torch.device("cuda", 3)))]
    calls.clear()
    bind_device(torch.device("cpu"))
    assert calls == [("all_reduce", ("a tensor on", torch.device("cpu")))]


# -- the collectives of a run ---------------------------------------------------------------------------
def test_a_run_sends_its_per_step_objects_over_the_control_group(group, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path) -> None:
    """One rank, a separate gloo control group standing in for NCCL's companion: every
    object collective names it, and the default group sees one tensor collective (the
    device binding) however many steps run, not a broadcast of the loss per step."""
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    monkeypatch.setattr(train_module, "control_group", lambda: control)
    seen: list[tuple[str, object]] = []

    def recording(name: str):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            seen.append((name, kwargs.get("group")))
            return real(*args, **kwargs)
        return call

    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "broadcast", "all_reduce",
                 "all_gather", "barrier"):
        monkeypatch.setattr(dist, name, recording(name))
    steps = 3
    cfg = TrainConfig(model="gpt-tiny", num_stages=1, microbatch_size=2, num_microbatches=2, steps=steps,
                      plan="none", log_every=1)
    assert train_module.train(cfg) == 0
    objects = [g for name, g in seen if name.endswith("_object") or name.endswith("_object_list")]
    assert objects and all(g is control for g in objects), seen
    on_default = [name for name, g in seen if g is None]
    # bind_device's, once, and per step the pipeline's one small verdict on a non-finite
    # loss (without clipping; with it, the norm's all-reduce carries it): no object
    assert on_default == ["all_reduce"] * (1 + steps), seen


# -- NCCL's own error handling --------------------------------------------------------------------------
def test_nccl_error_handling_is_set_before_the_process_group_is_made(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path) -> None:
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (abort the communicators, then tear
    the process down); the launcher sets 3, tear down without the abort, before NCCL reads it."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}.items():
        monkeypatch.setenv(key, value)
    seen: dict[str, str | None] = {}

    def init_process_group(*args, **kwargs):
        seen["value"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        raise UserError("no process group in this test")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    path = tmp_path / "train.yaml"
    path.write_text("model: gpt-tiny\nplan: none\n")
    assert train_module.main(["--config", str(path)]) == 2
    assert seen == {"value": "3"}
