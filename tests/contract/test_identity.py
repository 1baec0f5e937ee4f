"""The contract between the halves: the profiler (plan time) and the router (run time) see
the same layers and name the same saved tensors, for the reference models and for
user-style modules, and a stage's rules decide the same way in the rewriter and in the
router.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpress.contract.actions import Action, Kind, UnitId, UnitKind
from mpress.hardware.server import load_hardware
from mpress.contract.identity import SavedTensorNamer, StageRules, inspect_stage, layer_paths
from mpress.config.model_config import load_model_config
from mpress.models import build_stage, example_batch, lm_loss
from mpress.contract.plan import Plan, StagePlan, TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.program import RankProgram
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine
from mpress.static.profile.measured import measure_profile
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.plan.rewriter import layer_tensors, rewrite
from mpress.static.schedules import build_schedule

CPU = torch.device("cpu")


# ---- user-style modules ------------------------------------------------------------------------

class Residual(nn.Module):
    """x + fc2(relu(fc1(x))): the children are not a chain (the input skips them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TwoBranches(nn.Module):
    """a(x) * b(x): both children see the input, neither sees the other's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


class Chain(nn.Module):
    """Children called one after the other on each other's output: each is a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.second = Residual()
        self.third = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)))


class Marked(nn.Module):
    """Marks its own split points (a residual stack is no chain by call order)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual(), Residual(), Residual()])

    def layer_names(self) -> list[str]:
        return [f"blocks.{i}" for i in range(3)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))  # the tanh runs in the root, between the layers
        return x


USER_MODULES = {
    "residual": (Residual, [""]),
    "two branches": (TwoBranches, [""]),
    "sequential": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), ["0", "1", "2"]),
    "chain": (Chain, ["first", "second", "third"]),
    "marked": (Marked, ["blocks.0", "blocks.1", "blocks.2"]),
}


def profile_of(module: nn.Module, x: torch.Tensor, loss_fn=None):
    return measure_profile(module, x, model_name="user", fingerprint="-", microbatch_size=x.shape[0],
                           loss_fn=loss_fn, warmup=0, iters=1)


@pytest.mark.parametrize("name", sorted(USER_MODULES))
def test_profiler_and_router_see_the_same_layers_and_tensors(name):
    make, layers = USER_MODULES[name]
    torch.manual_seed(0)
    module, x = make(), torch.randn(4, 8, requires_grad=True)
    profile = profile_of(module, x)
    runtime = inspect_stage(module, (x,))
    assert profile.layer_names() == [t.name for t in runtime] == layers
    # the default loss sums the output: it saves nothing, so every id is the forward's
    assert [[t.id for t in layer.saved] for layer in profile.layers] == [list(t.saved) for t in runtime]
    assert sum(len(t.saved) for t in runtime) > 0


def test_the_residual_module_is_one_layer_for_both_halves():
    """The reproduced mismatch: the profiler said [''], the runtime ['fc1', 'fc2']."""
    x = torch.randn(2, 8)
    module = Residual()
    router = SavedTensorRouter(module, StagePlan(stage=0, device=0, first_layer=0, end_layer=1,
                                                 rules=[TensorRule(tensor="*", technique="keep")]),
                               RankProgram([], rank=0), rank=0, example_args=(x,))
    assert layer_paths(module, (x,)) == [""] == list(router.layers) == profile_of(module, x).layer_names()
    router.close()


def test_a_tensor_saved_outside_every_module_belongs_to_the_last_layer():
    torch.manual_seed(0)
    module, x = Chain(), torch.randn(4, 8)
    loss_fn = lambda out: (out ** 2).sum()  # noqa: E731 - pow saves its input, outside every module
    profile = profile_of(module, x, loss_fn)
    namer = SavedTensorNamer(module, layer_paths(module, (x,)))
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(namer.name(t)) or t, lambda t: t):
        namer.begin()
        loss_fn(module(x)).backward()
        namer.end()
    namer.close()
    outside = [n for n in seen if n is not None][-1]
    assert (outside.module, outside.layer) == ("third", 2)  # the last layer's path and index
    assert profile.layers[-1].saved[-1].id == outside.id
    assert outside.id == f"third#{len(profile.layers[-1].saved) - 1}"


def test_inspection_leaves_random_streams_and_buffers_alone():
    module = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8))
    x = torch.randn(4, 8)
    before = [b.clone() for b in module.buffers()]
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    inspect_stage(module, (x,))
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a, b) for a, b in zip(before, module.buffers()))


@pytest.mark.parametrize("model", ["gpt-tiny", "bert-tiny"])
def test_reference_models_profile_and_route_alike(model):
    """The profile adds the loss's tensors (outside every module: the head's) to what the
    router sees in the forward; everything else is the same list."""
    cfg = load_model_config(model)
    stage = build_stage(cfg, 0, cfg.num_layers + 2, seed=1)
    x, y = example_batch(cfg, 2, seed=0)
    profile = profile_of(stage, x, lambda out: lm_loss(out, y))
    runtime = inspect_stage(stage, (x,))
    assert profile.layer_names() == [t.name for t in runtime] == stage.layer_names()
    for layer, seen in zip(profile.layers, runtime):
        ids = [t.id for t in layer.saved]
        assert ids[:len(seen.saved)] == list(seen.saved)
        extra = ids[len(seen.saved):]
        assert extra == [] or (layer.name == "head" and all(i.startswith("head#") for i in extra))


# ---- one reading of the rules ------------------------------------------------------------------

RULES = [
    TensorRule(tensor="layers.0.*#*", technique="recompute"),  # a glob the plan format documents
    TensorRule(tensor="layers.1.mlp.**", technique="host", microbatches="0,2"),
    TensorRule(tensor="layers.1.**", technique="recompute", microbatches="1"),
    TensorRule(tensor="layers.2.attn.*#0", technique="host"),
    TensorRule(tensor="head.**", technique="keep"),
]


def _plan(cfg, rules: list[TensorRule], num_microbatches: int) -> Plan:
    end = cfg.num_layers + 2
    return Plan(strategy="test", model=cfg.name, model_fingerprint=cfg.fingerprint(), dtype=cfg.precision, profile_fingerprint="-",
                hardware="cpu-local", hardware_fingerprint="-", num_devices=1, device_memory_bytes=1 << 30,
                schedule="gpipe", num_stages=1, num_ranks=1, num_microbatches=num_microbatches, microbatch_size=2,
                stage_to_device=[0], stages=[StagePlan(stage=0, device=0, first_layer=0, end_layer=end, rules=rules)],
                fits=True)


def _rewritten(cfg, rules: list[TensorRule], num_mb: int):
    """gpt-tiny as one stage, its profile's costs, and the program the rewriter makes of
    `rules` for GPipe (plan time)."""
    stage = build_stage(cfg, 0, cfg.num_layers + 2, seed=1)
    batches = [example_batch(cfg, 2, seed=m) for m in range(num_mb)]
    profile = profile_of(stage, batches[0][0], lambda out: lm_loss(out, batches[0][1]))
    plan = _plan(cfg, rules, num_mb)
    costs = stage_costs(profile, [(0, cfg.num_layers + 2)])
    rewritten = rewrite(plan, build_schedule("gpipe", 1, num_mb), costs, load_hardware("cpu-local", num_devices=1))
    return stage, batches, plan, costs, rewritten


def _run_program(stage, batches, plan: Plan, actions: list[Action]):
    """Run `actions` as rank 0's program with the router (run time), as the pipeline
    stage and the job do: F and B begun and ended, the loss routed, OPT begun (nothing to
    step here). Returns the program, the router and each swapped tensor (microbatch,
    id, bytes)."""
    program = RankProgram(actions, rank=0)
    engine = SwapEngine(PinnedHostPool(16 << 20), MemoryManager(CPU, rank=0), CPU, rank=0, stage=0)
    router = SavedTensorRouter(stage, plan.stage(0), program, rank=0, example_args=(batches[0][0],), engine=engine,
                               num_microbatches=len(batches))
    program.on(Kind.SI, 0, router.prefetch_unit)
    program.on_release(engine.wait_outs)
    swapped: list[tuple[int, str, int]] = []
    swap_out = engine.swap_out_group
    engine.swap_out_group = lambda key, parts, **kw: (
        swapped.extend((key.microbatch, n, t.numel() * t.element_size()) for n, t in parts)
        or swap_out(key, parts, **kw))
    try:
        losses = []
        for m, (x, y) in enumerate(batches):
            program.begin(Action(0, Kind.F, m))
            with router.microbatch(m):
                out = stage(x)
            program.end()
            losses.append(router.route_loss(lm_loss)(out, y))
        for m, loss in enumerate(losses):
            program.begin(Action(0, Kind.B, m))
            loss.backward()
            router.finish(m)
            program.end()
        for action in program.optimizer_actions():
            program.begin(action)
            program.end()
        program.end_step()
    finally:
        router.close()
        engine.close()
    return program, router, swapped


def test_a_rule_decides_the_same_at_plan_time_and_at_run_time():
    """The rewriter's program (plan time) runs under the router (run time): each unit it
    compacts is one the router makes of the real forward's saved tensors (each SO had
    tensors to move, each DR a layer to checkpoint, each RC a recompute: the executed
    log is the list, with nothing else), and the tensors swapped are the ones the
    profile puts in the swapped units, with the bytes the plan counts on freeing."""
    cfg = load_model_config("gpt-tiny")
    num_mb = 3
    stage, batches, plan, costs, rewritten = _rewritten(cfg, RULES, num_mb)
    actions = list(rewritten.schedule.ranks[0])
    rules = StageRules(plan.stage(0), layer_tensors(costs[0]), num_mb)  # the rewriter's reading
    planned: dict[int, dict[str, set]] = {m: {"dropped": set(), "swapped": set()} for m in range(num_mb)}
    planned_bytes: dict[tuple[int, str], int] = {}
    for action in actions:
        if action.kind in (Kind.DR, Kind.SO):
            unit = UnitId.parse(action.tensor)
            assert unit.kind is UnitKind.ACTIVATIONS
            what = "dropped" if action.kind is Kind.DR else "swapped"
            planned[action.microbatch][what].add((unit.layer, unit.rule))
        if action.kind is Kind.SO:
            planned_bytes[(action.microbatch, action.tensor)] = rewritten.tensors[action.tensor].bytes
    assert ("layers.0", 0) in planned[0]["dropped"]  # the glob recomputes the whole of block 0
    assert ("layers.1", 2) in planned[1]["dropped"] and ("layers.1", 1) in planned[0]["swapped"]

    program, router, swapped = _run_program(stage, batches, plan, actions)
    assert program.last_log == actions
    assert router.layers_recomputed == sum(len(planned[m]["dropped"]) for m in range(num_mb))
    layer_of = {t.id: layer.name for layer in costs[0].layers for t in layer.saved}
    ran_bytes: dict[tuple[int, str], int] = {}
    for m, tensor, nbytes in swapped:
        unit = (layer_of[tensor], router.rules.rule_index(tensor, m))
        assert unit in planned[m]["swapped"], (m, tensor)
        assert rules.rule_index(tensor, m) == unit[1]  # both halves read the rules alike
        key = (m, str(UnitId(0, UnitKind.ACTIVATIONS, layer=unit[0], rule=unit[1])))
        ran_bytes[key] = ran_bytes.get(key, 0) + nbytes
    assert ran_bytes == planned_bytes


def test_a_rule_naming_only_the_stage_input_makes_a_program_the_router_runs():
    """The stage's input is never moved (the pipeline holds it: swapping it frees
    nothing, as the memory model says). A rule that names only it (here the token ids
    that embed.tok saves) compacts nothing at run time, so the program must not list a
    swap-out the router cannot run (or the router must count it as run)."""
    cfg = load_model_config("gpt-tiny")
    stage, batches, plan, _costs, rewritten = _rewritten(cfg, [TensorRule(tensor="embed.tok#0", technique="host")], 2)
    actions = list(rewritten.schedule.ranks[0])
    assert all(rewritten.tensors[a.tensor].bytes == 0 for a in actions if a.kind is Kind.SO)  # frees nothing
    program, _router, swapped = _run_program(stage, batches, plan, actions)
    assert program.last_log == actions and swapped == []


def test_inspecting_a_stage_holds_what_a_forward_holds_while_it_runs():
    """A rank inspects its stage at start-up, before any plan has compacted anything: the
    inspection names each saved tensor and lets it go, so its peak is a no-grad forward's
    (here 2.4 MB), not one microbatch's saved activations all at once (16 MB)."""
    from torch import nn

    from mpress.contract.live_bytes import LiveBytes

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(),
                                                      nn.Linear(256, 64)) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    torch.manual_seed(0)
    module, x = Chain(), torch.randn(8, 128, 64)
    layers = [f"layers.{i}" for i in range(6)]
    peaks = {}
    for what, run in (("inspect", lambda: inspect_stage(module, (x,), layers)),
                      ("no_grad", lambda: torch.no_grad()(module)(x)), ("forward", lambda: module(x))):
        with LiveBytes() as live:
            out = run()
            del out
            peaks[what] = live.peak_bytes
    assert peaks["inspect"] == peaks["no_grad"] < peaks["forward"] / 4
    named = inspect_stage(module, (x,), layers)
    assert [len(layer.saved) for layer in named] == [len(named[0].saved)] * 6 and named[0].saved
