"""LiveBytes: every storage an operator makes on a watched thread, counted until it dies;
views add nothing; adopted storages count; host storages and what is made from them
alone do not; over the capacity, one clear out-of-memory error."""

from __future__ import annotations

import threading

import pytest
import torch

from mpress.errors import DeviceOutOfMemory
from mpress.contract.live_bytes import LiveBytes


def test_storages_count_while_they_live_and_views_add_nothing():
    live = LiveBytes(rank=0)
    with live.watch():
        a = torch.ones(256)                 # 1024 B
        b = a.view(16, 16)[2:]              # a view: nothing new
        a.add_(1)                           # in place: nothing new
        c = a * 2                           # 1024 B
        assert live.live_bytes == 2048
        del c
        assert live.live_bytes == 1024
        del a, b
    assert live.live_bytes == 0
    assert live.peak_bytes == 2048


def test_adopted_and_host_storages():
    live = LiveBytes(rank=0)
    params = torch.zeros(100)  # made before watching
    host = torch.zeros(1000)
    live.adopt(params, "parameter w")
    live.adopt(host, "pinned pool", host=True)
    assert live.live_bytes == 400 and live.counts(params) and live.is_host(host)
    with live.watch():
        on_host = host + 1           # made from host storages alone: host memory
        on_device = params + host[:100]
    assert live.live_bytes == 800
    assert not live.counts(on_host) or live.is_host(on_host)
    assert live.counts(on_device) and not live.is_host(on_device)


def test_other_threads_count_when_they_watch():
    live = LiveBytes(rank=0)
    kept = []

    def worker() -> None:
        with live.watch():
            kept.append(torch.empty(1000, dtype=torch.uint8))
            torch.empty(500, dtype=torch.uint8)  # dies at once

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert live.live_bytes == 1000 and live.peak_bytes == 1500
    torch.empty(10_000)  # this thread does not watch: not counted
    assert live.live_bytes == 1000


def test_the_peak_restarts_from_what_is_live_and_names_the_action():
    live = LiveBytes(rank=0)
    with live.watch():
        live.context = "0F0"
        a = torch.empty(1000, dtype=torch.uint8)
        live.context = "0B0"
        torch.empty(3000, dtype=torch.uint8)
        assert (live.peak_bytes, live.peak_context) == (4000, "0B0")
        live.reset_peak()
        assert live.peak_bytes == 1000
        live.context = "0OPT"
        torch.empty(100, dtype=torch.uint8)
    assert (live.peak_bytes, live.peak_context) == (1100, "0OPT")
    del a


def test_going_over_the_capacity_is_one_clear_error_naming_rank_action_and_residents():
    live = LiveBytes(rank=3, capacity_bytes=10_000)
    weight = torch.zeros(1000)
    live.adopt(weight, "parameter layers.0.w")  # 4000 B
    live.context = "3B7"
    with live.watch(), pytest.raises(DeviceOutOfMemory) as err:
        keep = torch.empty(5000, dtype=torch.uint8)
        torch.empty(2000, dtype=torch.uint8)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("rank 3 3B7: out of device memory: empty in 3B7 (2 KB) takes the live bytes to "
                              "11,000 B, over the capacity of 10,000 B; largest: ")
    assert message.endswith("largest: empty in 3B7 7 KB, parameter layers.0.w 4 KB")  # same names summed
    del keep


def test_what_an_operator_makes_and_keeps_is_counted_once():
    live = LiveBytes(rank=0)
    x = torch.randn(8, 8, requires_grad=True)
    live.adopt(x, "input")
    with live.watch():
        y = (x * 2).sum()           # a (8, 8) temporary and a scalar
        y.backward()                # x.grad (256 B) and the seed (4 B) made by the engine
    assert live.counts(x.grad)
    assert live.live_bytes == 256 + 256 + 4  # x, x.grad, y
