"""`balance_choice.choose_balance`: which split a strategy is planned on, and what is
planned to decide it, for each verdict of the memory model.

The setups are real (analytic profiles, both partitions, the memory model); the devices'
memory is set between the two splits' floors, worked out here from the memory model, so
each verdict is the one named. The planner is the collaborator the choice calls: a
recorder stands in for it where the test needs a plan that does or does not fit (the
planner itself, on these setups, is `tests/commands/test_plan_cli.py`'s)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mpress.config.model_config import load_model_config
from mpress.config.vocabulary import ScheduleName, Strategy
from mpress.hardware.server import load_hardware
from mpress.static.plan.balance_choice import choose_balance, floor_bytes, ruled_out
from mpress.static.plan.evaluate import setup_pipeline


def _setups(model: str, microbatch_size: int, usable: int | None = None):
    """(compute split, memory split) of `model` on dgx1-v100's 8 GPUs, with `usable`
    bytes usable per device (None: the preset's)."""
    hw = load_hardware("dgx1-v100")
    if usable is not None:
        hw = load_hardware("dgx1-v100", memory_bytes=usable + hw.device.memory_bytes - hw.usable_memory_bytes)
        assert hw.usable_memory_bytes == usable
    cfg = load_model_config(model)
    return tuple(setup_pipeline(cfg, hw, schedule=ScheduleName.ONE_F_ONE_B, num_stages=8,
                                microbatch_size=microbatch_size, num_microbatches=16, balance=b)
                 for b in ("compute", "memory"))


def _worst(setup, strategy: str) -> int:
    return max(floor_bytes(setup, strategy))


@dataclass
class _Result:
    fits: bool


class _Planner:
    """Records what the choice plans; `fits[split]`: whether the strategy fits there."""

    def __init__(self, fits: dict[str, bool]) -> None:
        self.fits, self.calls = fits, []

    def __call__(self, balance: str, names: list[str]) -> dict[str, _Result]:
        self.calls.append((balance, list(names)))
        return {n: _Result(self.fits[balance]) for n in names}


def _choose(by_compute, by_memory, fits: dict[str, bool], strategy: str = "none"):
    laid_out = []

    def memory():
        laid_out.append(True)
        return by_memory

    said: list[str] = []
    planner = _Planner(fits)
    chosen = choose_balance(by_compute, memory, strategy, planner, said.append)
    return chosen, planner.calls, said, bool(laid_out)


@pytest.fixture(scope="module")
def bert():
    """bert-4b, 4 sequences a microbatch: `none`'s floor (the whole need) is 29.9 GB on
    the compute split's stage 0, 26.2 GB at most on the memory split."""
    compute, memory = _setups("bert-4b", 4)
    assert _worst(memory, "none") < _worst(compute, "none")
    return _worst(compute, "none"), _worst(memory, "none")


def test_memory_is_chosen_up_front_where_the_model_rules_out_compute_only(bert):
    usable = (bert[0] + bert[1]) // 2
    compute, memory = _setups("bert-4b", 4, usable)
    assert ruled_out(compute, "none") and not ruled_out(memory, "none")
    chosen, calls, said, _ = _choose(compute, memory, {"compute": True, "memory": True})
    assert chosen == "memory" and calls == [("memory", ["none"])]  # compute never planned
    assert "cannot fit the layers balanced by compute by the memory model (stage 0 keeps" in said[0]
    # the strategy does not fit memory either: the split where another one fits, compute first
    chosen, calls, _, _ = _choose(compute, memory, {"compute": True, "memory": False})
    assert chosen == "compute" and calls == [("memory", ["none"]), ("compute", list(Strategy.words()))]


def test_compute_is_kept_unplanned_where_the_model_rules_out_both(bert):
    compute, memory = _setups("bert-4b", 4, bert[1] - (1 << 30))
    chosen, calls, said, _ = _choose(compute, memory, {"compute": False, "memory": False})
    assert chosen == "compute" and calls == []  # planned once, afterwards, with the others
    assert "nor by memory" in said[0]


def test_compute_is_planned_first_where_the_model_allows_it_and_memory_only_if_needed(bert):
    compute, memory = _setups("bert-4b", 4, bert[0] + (1 << 30))
    assert not ruled_out(compute, "none") and not ruled_out(memory, "none")
    chosen, calls, said, laid_out = _choose(compute, memory, {"compute": True, "memory": True})
    assert (chosen, calls, said, laid_out) == ("compute", [("compute", ["none"])], [], False)
    chosen, calls, said, _ = _choose(compute, memory, {"compute": False, "memory": True})
    assert chosen == "memory" and calls == [("compute", ["none"]), ("memory", ["none"])]
    assert "trying them balanced by memory" in said[0]


def test_memory_is_not_planned_after_compute_fails_where_the_model_rules_it_out():
    """gpt-10.3b, 2 sequences a microbatch: its memory split needs a little more than
    its compute split (the memory partition balances one microbatch, not the first
    stage's eight in flight), so usable memory between the two rules out memory only."""
    compute, memory = _setups("gpt-10.3b", 2)
    low, high = _worst(compute, "none"), _worst(memory, "none")
    assert low < high
    compute, memory = _setups("gpt-10.3b", 2, (low + high) // 2)
    assert not ruled_out(compute, "none") and ruled_out(memory, "none")
    chosen, calls, said, _ = _choose(compute, memory, {"compute": False, "memory": True})
    assert chosen == "compute" and calls == [("compute", ["none"])]
    assert "the memory model rules out balancing them by memory" in said[0]


def test_the_floors_order_the_strategies_as_their_techniques_do(bert):
    """What a strategy cannot move shrinks as it may move more: none keeps everything,
    recompute the model states, the swapping strategies only parameters, gradients,
    buffers and the largest transient."""
    compute, _ = _setups("bert-4b", 4)
    for s, m in enumerate(compute.memory):
        none, recompute, swap = (floor_bytes(compute, x)[s] for x in ("none", "recompute", "mpress"))
        assert none == m.total_bytes > recompute >= swap
        assert recompute - swap == m.optim_bytes + m.master_bytes + m.stash_bytes
        assert floor_bytes(compute, "host-swap")[s] == floor_bytes(compute, "d2d")[s] == swap
