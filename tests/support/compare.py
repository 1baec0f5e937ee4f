"""Bit-for-bit comparison of training runs (`torch.equal`, never a tolerance)."""

from __future__ import annotations

import torch


def assert_states_equal(a: dict, b: dict) -> None:
    """Model and optimizer states equal tensor for tensor (`torch.equal`)."""
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for pid, per_param in a["optimizer"]["state"].items():
        for k, v in per_param.items():
            assert torch.equal(v, b["optimizer"]["state"][pid][k]), (pid, k)


def assert_masters_equal(a: dict, b: dict) -> None:
    """The same fp32 master weights (or none on both sides)."""
    masters = a.get("masters", {})
    assert masters.keys() == b.get("masters", {}).keys()
    for name, t in masters.items():
        assert torch.equal(t, b["masters"][name]), name


def assert_identical(a: list[dict], b: list[dict], *, masters: bool = False) -> None:
    """Two runs, rank by rank: the same losses and final states (and masters, if asked)."""
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert_states_equal(ra["state"], rb["state"])
        if masters:
            assert_masters_equal(ra["state"], rb["state"])
