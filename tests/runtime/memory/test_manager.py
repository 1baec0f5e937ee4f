"""MemoryManager: residency, per-category accounting, peaks, errors, thread safety."""

import json
import threading
from functools import partial

import pytest
import torch

from mpress.errors import SwapError
from mpress.contract.identity import TensorKey
from mpress.runtime.memory.manager import Category, MemoryManager, Residency
from tests.support import keys

CPU = torch.device("cpu")
key = partial(keys.key, rank=1, stage=2)
"""The managers below run as rank 1; messages name a key's rank and stage."""


def test_tensor_key_reads_as_a_sentence():
    assert str(TensorKey(1, 1, 3, "layers.2.mlp.fc1#0")) == (
        "rank 1 stage 1 microbatch 3 tensor layers.2.mlp.fc1#0")
    assert str(TensorKey(0, 4, None, "optim:w:exp_avg")) == "rank 0 stage 4 tensor optim:w:exp_avg"
    assert len({key("a"), key("a"), key("b")}) == 2


def test_track_move_forget_accounting():
    mm = MemoryManager(CPU, rank=1)
    mm.track(key("a#0"), 100, Category.ACTIVATION)
    mm.track(key("b#0"), 50, Category.ACTIVATION)
    mm.track(key("optim:w:exp_avg", None), 400, Category.OPTIMIZER)
    assert mm.device_bytes() == 550
    assert mm.device_bytes(Category.ACTIVATION) == 150
    mm.move(key("a#0"), Residency.HOST)
    mm.move(key("optim:w:exp_avg", None), Residency.PEER, peer=3)
    assert (mm.device_bytes(), mm.host_bytes(), mm.peer_bytes(), mm.peer_bytes(3), mm.peer_bytes(4)) == (
        50, 100, 400, 400, 0)
    assert mm.residency(key("a#0")) is Residency.HOST
    assert (mm.bytes_moved_out, mm.bytes_moved_in) == (500, 0)
    mm.move(key("a#0"), Residency.DEVICE)
    assert (mm.bytes_moved_out, mm.bytes_moved_in) == (500, 100)
    assert mm.device_bytes(Category.ACTIVATION) == 150
    mm.forget(key("a#0"))
    mm.forget(key("b#0"))
    mm.forget(key("optim:w:exp_avg", None))
    assert (mm.device_bytes(), mm.host_bytes(), mm.peer_bytes()) == (0, 0, 0)


def test_peaks_per_category_and_total():
    mm = MemoryManager(CPU, rank=0)
    mm.track(key("a"), 100, Category.ACTIVATION)
    mm.move(key("a"), Residency.HOST)
    mm.track(key("s"), 70, Category.OPTIMIZER)
    mm.track(key("m"), 10, Category.MASTER, Residency.HOST)  # born off device
    assert mm.peak_device_bytes(Category.ACTIVATION) == 100
    assert mm.peak_device_bytes(Category.OPTIMIZER) == 70
    assert mm.peak_device_bytes(Category.MASTER) == 0
    # The peak of the total is 100, not the sum of the per-category peaks (170).
    assert mm.peak_device_bytes() == 100
    mm.move(key("a"), Residency.DEVICE)
    assert mm.peak_device_bytes() == 170
    mm.forget(key("s"))
    mm.reset_peaks()
    assert mm.peak_device_bytes() == 100 and mm.peak_device_bytes(Category.OPTIMIZER) == 0


def test_errors_name_the_key():
    mm = MemoryManager(CPU, rank=1)
    k = key("layers.0.fc#1", 3)
    with pytest.raises(SwapError, match=r"rank 1 stage 2 microbatch 3 tensor layers.0.fc#1 is not tracked \(cannot move to host\)"):
        mm.move(k, Residency.HOST)
    mm.track(k, 8, Category.ACTIVATION)
    with pytest.raises(SwapError, match="already tracked"):
        mm.track(k, 8, Category.ACTIVATION)
    mm.forget(k)
    with pytest.raises(SwapError, match=r"tensor layers.0.fc#1 was forgotten \(cannot move to host\)"):
        mm.move(k, Residency.HOST)
    with pytest.raises(SwapError, match="forgotten"):
        mm.forget(k)
    with pytest.raises(SwapError, match="forgotten"):
        mm.residency(k)
    mm.track(k, 8, Category.ACTIVATION)  # the next iteration's tensor of the same name
    assert mm.is_tracked(k)


def test_report_is_plain_data():
    mm = MemoryManager(CPU, rank=3)
    mm.track(key("a"), 100, Category.ACTIVATION)
    mm.track(key("o"), 300, Category.OPTIMIZER)
    mm.move(key("o"), Residency.HOST)
    report = mm.report()
    json.dumps(report)  # only plain types
    assert report["rank"] == 3 and report["device"] == "cpu"
    assert report["device_bytes"] == 100 and report["host_bytes"] == 300
    assert report["categories"]["optimizer"] == {
        "num_tensors": 1, "device_bytes": 0, "peak_device_bytes": 300}
    assert report["peak_device_bytes"] == 400 and report["bytes_moved_out"] == 300


def test_cuda_consistency_is_a_no_op_on_cpu():
    mm = MemoryManager(CPU, rank=0)
    mm.track(key("a"), 10**12, Category.ACTIVATION)  # far more than was ever allocated
    assert mm.check_cuda_consistency(tolerance_bytes=0) is None


def test_concurrent_updates_keep_totals_exact():
    mm = MemoryManager(CPU, rank=0)

    def worker(tag: int) -> None:
        for i in range(200):
            k = key(f"w{tag}#{i}")
            mm.track(k, 10, Category.ACTIVATION)
            mm.move(k, Residency.HOST)
            mm.move(k, Residency.DEVICE)
            mm.forget(k)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (mm.device_bytes(), mm.host_bytes()) == (0, 0)
    assert mm.bytes_moved_out == mm.bytes_moved_in == 8 * 200 * 10
    assert 10 <= mm.peak_device_bytes() <= 80


@pytest.mark.cuda
def test_cuda_consistency_against_the_allocator():
    device = torch.device("cuda")
    mm = MemoryManager(device, rank=0)
    tensor = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    mm.track(key("t"), tensor.numel(), Category.ACTIVATION)
    result = mm.check_cuda_consistency(tolerance_bytes=0)
    assert result.tracked_device_bytes == 1 << 20 and result.allocated_delta_bytes >= 1 << 20
    mm.track(key("ghost"), 1 << 30, Category.ACTIVATION)  # never allocated
    with pytest.raises(SwapError, match="out of date"):
        mm.check_cuda_consistency(tolerance_bytes=1 << 20)
    del tensor
