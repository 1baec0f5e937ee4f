"""StripeTable (run-time metadata of striped tensors, pure): the life cycle of its entries,
two entries for one tensor while a discarded copy finishes, errors that name the entry.
(Moved out of tests/d2d/static/test_striping.py, which tests the striping arithmetic.)"""

from __future__ import annotations

import pytest
import torch

from mpress.d2d.runtime.stripe_table import StripeState, StripeTable
from mpress.errors import SwapError
from mpress.runtime.memory.block_pool import BlockPool
from mpress.runtime.swap.store import Placement, Slot

POOLS = {peer: BlockPool(torch.zeros(1 << 20, dtype=torch.uint8), alignment_bytes=16, name=f"peer {peer}")
         for peer in (1, 2)}


def placement(entry_id: int) -> Placement:
    """4096 bytes: 3072 on peer 1, 1024 on peer 2."""
    return Placement((Slot(1, POOLS[1].allocate(3072, "t"), 0, 3072), Slot(2, POOLS[2].allocate(1024, "t"), 3072, 1024)),
                     entry_id=entry_id)


def test_table_life_cycle():
    table = StripeTable()
    a = table.add("a", placement(0))
    table.add("b", placement(1))
    assert [e.owner for e in table.entries()] == ["a", "b"]
    assert a.state is StripeState.RESERVED and a.nbytes == 4096
    assert [(s.peer, s.tensor_offset_bytes, s.nbytes) for s in a.stripes] == [(1, 0, 3072), (2, 3072, 1024)]
    for state in (StripeState.WRITING, StripeState.ON_PEERS, StripeState.READING, StripeState.READ):
        updated = table.update(0, state)
        assert updated.state is state and table.entries()[0] == updated
        assert updated.stripes == a.stripes  # updates change the state only
    assert table.entries()[1].state is StripeState.RESERVED
    removed = table.remove(0)
    assert removed.state is StripeState.READ
    assert [e.owner for e in table.entries()] == ["b"]


def test_one_tensor_may_have_two_entries_while_a_discarded_copy_finishes():
    table = StripeTable()
    table.add("x", placement(0))
    table.update(0, StripeState.WRITING)
    table.add("x", placement(1))
    assert [e.state for e in table.entries() if e.owner == "x"] == [StripeState.WRITING, StripeState.RESERVED]
    table.remove(0)
    assert [e.state for e in table.entries()] == [StripeState.RESERVED]


def test_table_errors_name_the_entry():
    table = StripeTable()
    table.add("rank 0 stage 1 microbatch 2 tensor x#0", placement(3))
    with pytest.raises(SwapError, match=r"entry 3 \(rank 0 stage 1 microbatch 2 tensor x#0\) exists already"):
        table.add("rank 0 stage 1 microbatch 2 tensor x#0", placement(3))
    for call in (table.remove, lambda i: table.update(i, StripeState.READ)):
        with pytest.raises(SwapError, match="no entry 4"):
            call(4)
    table.remove(3)
    with pytest.raises(SwapError, match="no entry"):
        table.remove(3)
    assert table.entries() == []
