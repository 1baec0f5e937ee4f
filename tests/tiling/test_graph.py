"""The dimension-connection graph and segmentation: Sequential and torch.fx DAGs, cuts,
must/may-tile classes, segment growth, FT-dimension intersection, DAG verdicts."""

import torch
from torch import nn

from mpress.tiling.graph import from_fx, from_sequential, leaf_modules
from mpress.tiling.networks import vgg16
from mpress.tiling.planner import DagPlan, OutOfMemory, plan_dag
from mpress.tiling.segments import (
    classify,
    cut_positions,
    grow_segments,
    maximal_segments,
    surviving_dims,
)


class Residual(nn.Module):
    """stem -> (3x3 branch + 1x1 branch) -> relu -> pool -> spatial mean -> linear."""

    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.a = nn.Conv2d(width, width, 3, padding=1)
        self.b = nn.Conv2d(width, width, 1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.pool(torch.relu(self.a(x) + self.b(x)))
        return self.head(y.mean(dim=(2, 3)))


class SqueezeExcite(nn.Module):
    """A branch through a global mean rescales the full-resolution tensor."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.conv(x)
        s = torch.sigmoid(self.fc(x.mean(dim=(2, 3))))
        return x * s.view(1, 8, 1, 1)


def test_sequential_graph_flattens_nested_sequentials_and_tracks_shapes():
    g = from_sequential(vgg16(width_div=16), (1, 3, 64, 48))
    assert [n for n, _ in leaf_modules(vgg16())][:3] == ["features.0", "features.1", "features.2"]
    assert g.is_chain() and g.nodes[-1].name == "head.2"
    assert g.tensors["features.30"].shape == (1, 32, 2, 1)
    assert g.tensors["head.2"].shape == (1, 10)
    classes = classify(g, 0)
    assert {classes[n] for n in ("head.0", "head.1", "head.2")} == {"cannot"}
    assert all(classes[n.name] == "must" for n in g.nodes[:31])


def test_maximal_segment_of_a_sequential_stops_at_the_head():
    g = from_sequential(vgg16(width_div=16), (1, 3, 64, 64))
    (seg,) = maximal_segments(g)
    assert seg.positions == tuple(range(31)) and seg.input == "input" and seg.output == "features.30"
    assert seg.tile_dims == (2, 3) and 0 in seg.dims and 1 not in seg.dims  # channels do not survive convs


def test_segments_grow_to_the_first_checkpointable_tensors():
    g = from_sequential(vgg16(width_div=16), (1, 3, 64, 64))
    # 4 channels x 64 x 64 x 4 B = 65536 B per tensor of the first block; pool1 output: 16384 B
    segs = grow_segments(g, 20_000)
    first = segs[0]
    assert first.positions == (0, 1, 2, 3, 4)  # conv, relu, conv, relu, pool: ends at pool1's output
    assert first.must_tile == ("features.0", "features.1", "features.2", "features.3")
    assert g.tensors[first.output].nbytes <= 20_000
    # a lower threshold makes later layers must-tile too and moves the end further
    assert grow_segments(g, 1_000)[0].positions[-1] > first.positions[-1]


def test_fx_residual_branches_stay_in_one_segment_with_their_join():
    g = from_fx(Residual(), (1, 3, 64, 64))
    assert not g.is_chain()
    names = [n.name for n in g.nodes]
    cuts = cut_positions(g)
    # no cut between the fork (after relu) and the join (add): two tensors are live there
    assert names.index("add") + 1 in cuts
    assert names.index("a") + 1 not in cuts and names.index("b") + 1 not in cuts
    (seg,) = grow_segments(g, 50_000)  # every 8 x 64 x 64 float32 tensor (131 KB) must tile
    inside = {names[i] for i in seg.positions}
    assert {"stem", "a", "b", "add", "pool"} <= inside and "mean" not in inside
    assert seg.tile_dims == (2, 3)


def test_fx_dag_tile_sizes_and_plan():
    g = from_fx(Residual(width=32), (1, 3, 64, 64))  # 524 KB per full-resolution tensor
    plan = plan_dag(g, 450_000)
    assert isinstance(plan, DagPlan)
    (sp,) = plan.segments
    assert sp.num_tiles > 1 and sp.estimate_bytes <= 450_000
    # max over consumers: the stem output feeds a 3x3 and a 1x1 branch, its tile is the 3x3's need
    tile = sp.sizes.tensors
    assert tile["relu"][2] == tile["add"][2] + 2 and tile["stem"][2] == tile["relu"][2]
    assert tile["x"][2] == tile["stem"][2] + 2
    assert isinstance(plan_dag(g, 200_000), OutOfMemory)


def test_fx_global_branch_drops_spatial_dimensions_and_gives_a_verdict():
    g = from_fx(SqueezeExcite(), (1, 3, 64, 64))
    names = [n.name for n in g.nodes]
    losses = []
    dims = surviving_dims(g, tuple(range(len(names))), losses)
    assert 2 not in dims and 3 not in dims
    assert losses[0] == ("mean", (2, 3))  # the first operator on the path that needs the whole image
    verdict = plan_dag(g, 50_000)
    assert isinstance(verdict, OutOfMemory)
    assert "mul must tile" in verdict.message() and "131 KB" in verdict.message()


def test_fx_verdict_names_the_dimension_dropping_operator():
    class Softmaxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return torch.softmax(self.conv(x), dim=3)

    g = from_fx(Softmaxed(), (1, 3, 32, 32))
    verdict = plan_dag(g, 10_000)
    assert isinstance(verdict, OutOfMemory)
    assert "softmax" in verdict.message()
