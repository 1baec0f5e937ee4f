"""The saved-tensor router in one process, driven by a one-stage program as the pipeline
stage drives it: `program.begin(F)` / `end()` around each forward (inside
`router.microbatch(m)`; the loss after it through `route_loss`), `begin(B)` / `end()`
around each backward (`router.finish(m)` after it), `end_step()` at the end. The router
moves exactly the units the program compacts, by storage, and records what it ran."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mpress.contract.actions import Action, B, F, Kind, format_actions, parse_actions
from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.errors import PlanError
from mpress.contract.live_bytes import LiveBytes
from mpress.config.model_config import ModelConfig, load_model_config
from mpress.models import build_stage, example_batch
from mpress.contract.plan import TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from tests.support.plans import d2d_rule, three_stage_d2d_plan
from tests.support.router import make_router, step

CFG = load_model_config("gpt-tiny")
NUM_MB = 3
END = CFG.num_layers + 2
LAYERS = ["embed", *(f"layers.{i}" for i in range(CFG.num_layers)), "head"]
CPU = torch.device("cpu")
IN = {Kind.SO: Kind.SI, Kind.DO: Kind.DI}

Compact = Callable[[int], list[tuple[Kind, str]]]
"""Microbatch -> the (SO / DO / DR, unit) its forward compacts, in layer order."""


def unit(layer: str, rule: int = 0) -> str:
    return f"0:{layer}.**@r{rule}"


def gpipe(num_mb: int, compact: Compact) -> list[Action]:
    """Stage 0's GPipe list: every forward with the units it compacts inside it, then
    every backward; a swapped unit's swap-in right before its backward, a dropped unit's
    recompute inside it (last layer first), as the rewriter writes them."""
    acts: list[Action] = []
    for m in range(num_mb):
        acts += [F(0, m), *(Action(0, k, m, u) for k, u in compact(m))]
    for m in range(num_mb):
        acts += [Action(0, IN[k], m, u) for k, u in compact(m) if k in IN]
        acts += [B(0, m), *(Action(0, Kind.RC, m, u) for k, u in reversed(compact(m)) if k is Kind.DR)]
    return acts


def host_engine(**kw) -> SwapEngine:
    return SwapEngine(PinnedHostPool(64 << 20), MemoryManager(CPU, rank=0), CPU, rank=0, stage=0, **kw)


def run(rules: list[TensorRule] | None, compact: Compact = lambda m: [], *, d2d: SwapEngine | None = None,
        steps: int = 1):
    """GPipe steps of gpt-tiny (dropout on) under `rules` and the program `compact` makes;
    losses and gradients of the last step, and the router (None without rules)."""
    torch.manual_seed(0)
    model = build_stage(CFG, 0, END, seed=5)
    batches = [example_batch(CFG, 2, seed=m) for m in range(NUM_MB)]
    if rules is None:
        for _ in range(steps):
            model.zero_grad()
            losses = step(model, None, None, batches)
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, None
    engine = host_engine()
    router, program = make_router(model, rules, gpipe(NUM_MB, compact), batches[0][0], engine=engine, d2d=d2d, end=END)
    for _ in range(steps):
        model.zero_grad()
        losses = step(model, router, program, batches)
        assert program.last_log == program.actions  # every SO/DO/DR/RC listed ran, nothing else
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    router.close()
    engine.close()
    return losses, grads, router


def assert_identical(reference, result, what) -> None:
    """Same losses and bit-identical gradients (each run: losses, grads, ...)."""
    (losses, grads), (l2, g2) = reference[:2], result[:2]
    assert l2 == losses, what
    for name, g in grads.items():
        assert torch.equal(g, g2[name]), (what, name)


CASES = {
    "no activation rule": ([], lambda m: []),
    "keep": ([TensorRule(tensor="*", technique="keep")], lambda m: []),
    "host one layer": ([TensorRule(tensor="layers.1.**", technique="host")],
                       lambda m: [(Kind.SO, unit("layers.1"))]),
    "mixed": ([TensorRule(tensor="layers.0.**", technique="recompute"),
               TensorRule(tensor="layers.2.**", technique="host", microbatches="0,2"),
               TensorRule(tensor="layers.2.**", technique="recompute", microbatches="1")],
              lambda m: [(Kind.DR, unit("layers.0")),
                         (Kind.DR, unit("layers.2", 2)) if m == 1 else (Kind.SO, unit("layers.2", 1))]),
    "host everything": ([TensorRule(tensor="*", technique="host")],
                        lambda m: [(Kind.SO, unit(layer)) for layer in LAYERS]),
    "recompute everything": ([TensorRule(tensor="*", technique="recompute")],
                             lambda m: [(Kind.DR, unit(layer)) for layer in LAYERS]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_techniques_give_identical_gradients_with_dropout(case):
    """Keep, host swap and recompute, alone and mixed per microbatch, give the losses and
    bit-identical gradients of no router (dropout masks repeat in recomputes)."""
    rules, compact = CASES[case]
    reference = run(None, steps=2)
    result = run(rules, compact, steps=2)  # the second step starts the list from the top again
    assert_identical(reference, result, case)
    router = result[2]
    swaps = sum(k is Kind.SO for m in range(NUM_MB) for k, _u in compact(m))
    drops = sum(k is Kind.DR for m in range(NUM_MB) for k, _u in compact(m))
    assert (router.tensors_swapped > 0) == (swaps > 0) and router.tensors_swapped >= 2 * swaps
    assert router.layers_recomputed == 2 * drops


@pytest.fixture
def d2d_engine(group):
    """A D2D engine of stage 0 of `three_stage_d2d_plan` (shared-memory peer pools)."""
    plan = three_stage_d2d_plan()
    pools = setup_peer_pools(plan, [0, 1, 2], CPU)
    weights = tuple((s.device, s.fraction) for s in plan.stages[0].rules[0].stripes)
    store = PeerStore(pools, 0, CPU, weights, min_stripe_bytes=1 << 10, check_interval_s=0.0)
    engine = SwapEngine(store, MemoryManager(CPU, rank=0), CPU, rank=0, stage=0, timeout_s=10)
    yield engine
    engine.close(timeout_s=5)
    gc.collect()
    pools.close()


def test_d2d_swap_gives_identical_gradients_with_dropout(d2d_engine):
    rules = [d2d_rule("layers.*.**", {1: 0.75, 2: 0.25}), TensorRule(tensor="head.**", technique="host")]
    units = [*((Kind.DO, unit(f"layers.{i}")) for i in range(CFG.num_layers)), (Kind.SO, unit("head", 1))]
    result = run(rules, lambda m: units, d2d=d2d_engine, steps=2)
    assert_identical(run(None, steps=2), result, "d2d")
    stats = d2d_engine.stats
    assert stats.num_out > 0 and stats.num_in == stats.num_out  # every D2D-out came back


# ---- one storage, one decision ---------------------------------------------------------------

H = 16


class SavesTwice(nn.Module):
    """Saves one storage twice: y by the sine, then another view of it, y.view(-1, H), by
    the matmul (the weight is a parameter: never moved)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) / 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(x) * 2  # (B, T, H), a storage of its own
        return y.sin() + (y.view(-1, H) @ self.w).view_as(y)


def toy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()  # pow saves out - target, outside every module


def toy_run(rules: list[TensorRule] | None, program_text: str = "", *, num_mb: int = 2, middle=SavesTwice,
            last=lambda: nn.Linear(H, H), on_engine: Callable[[SwapEngine], None] = lambda e: None, **step_kw):
    """A GPipe step of a 3-layer toy ("0": Linear, "1": `middle()`, "2": Linear; its input
    (B, T, H) is the stage's) under `rules` and the program `program_text`. Returns
    losses, grads, the (microbatch, tensor) keys swapped out, the router and the engine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), middle(), last())
    batches = [(torch.randn(4, 8, H), torch.randn(4, 8, H)) for _ in range(num_mb)]
    torch.manual_seed(1)
    if rules is None:
        losses = step(model, None, None, batches, toy_loss)
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, [], None, None
    engine = host_engine()
    swapped: list[tuple[int, str]] = []
    swap_out = engine.swap_out_group
    engine.swap_out_group = lambda key, parts, **kw: (swapped.extend((key.microbatch, n) for n, _t in parts)
                                                      or swap_out(key, parts, **kw))
    on_engine(engine)
    router, program = make_router(model, rules, parse_actions(program_text), batches[0][0], engine=engine, end=3)
    losses = step(model, router, program, batches, toy_loss, **step_kw)
    assert program.last_log == program.actions
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    router.close()
    engine.close()
    return losses, grads, swapped, router, engine


HOST_ALL = [TensorRule(tensor="*", technique="host")]
# layer "0" saves only the stage's input: the program compacts nothing of it
TOY_PROGRAM = ("0F0 0SO0:0:1.**@r0 0SO0:0:2.**@r0 0F1 0SO1:0:1.**@r0 0SO1:0:2.**@r0 "
               "0SI0:0:1.**@r0 0SI0:0:2.**@r0 0B0 0SI1:0:1.**@r0 0SI1:0:2.**@r0 0B1")


def test_a_storage_saved_twice_is_swapped_once_and_both_saves_come_back():
    reference = toy_run(None)
    result = toy_run(HOST_ALL, TOY_PROGRAM)
    assert_identical(reference, result, "toy")
    _, _, swapped, router, engine = result
    # y is saved as 1#0 and again, as another view, as 1#1: one swap of its storage
    assert [t for m, t in swapped if m == 0] == ["1.drop#0", "1#0", "2#0", "2#1"]
    assert router.tensors_swapped == 8
    # one swap per unit and microbatch (layer 1's three tensors together), and one more
    # for the loss's tensor, saved after layer 2's group had left
    assert engine.stats.num_out == engine.stats.num_in == 6  # one fetch serves both saves of y


def test_the_stage_input_is_never_swapped():
    # "0" (a Linear on (B, T, H)) saves its input as a (B*T, H) view of the stage's input
    # storage, which the pipeline holds anyway: kept, though the rule names it
    result = toy_run(HOST_ALL, TOY_PROGRAM)
    assert not any(t.startswith("0#") for _m, t in result[2])
    with pytest.raises(PlanError, match="0SO0:0:0.\\*\\*@r0 inside 0F0, which did not execute it"):
        toy_run(HOST_ALL, "0F0 0SO0:0:0.**@r0 0F1 0B0 0B1")  # so listing it is an error


def test_a_loss_saved_outside_every_module_is_named_after_the_last_layer_and_routed():
    rules = [TensorRule(tensor="2#1", technique="host")]  # the loss's pow: after "2"'s own 2#0
    result = toy_run(rules, "0F0 0SO0:0:2.**@r0 0F1 0SI0:0:2.**@r0 0B0 0B1")
    assert_identical(toy_run(None), result, "loss")
    assert result[2] == [(0, "2#1")]  # microbatch 1's is kept: the program does not compact it


def test_units_the_program_does_not_list_are_kept_though_a_rule_names_them():
    result = toy_run(HOST_ALL, "0F0 0SO0:0:1.**@r0 0F1 0F2 0SO2:0:2.**@r0 0SI0:0:1.**@r0 0B0 0B1 "
                               "0SI2:0:2.**@r0 0B2", num_mb=3)
    assert_identical(toy_run(None, num_mb=3), result, "partial")
    assert result[2] == [(0, "1.drop#0"), (0, "1#0"), (2, "2#0"), (2, "2#1")]


def test_the_executed_log_is_the_program():
    rules = [TensorRule(tensor="1.**", technique="recompute"), TensorRule(tensor="2.**", technique="host")]
    text = ("0F0 0DR0:0:1.**@r0 0SO0:0:2.**@r1 0F1 0DR1:0:1.**@r0 0SI0:0:2.**@r1 0B0 0RC0:0:1.**@r0 "
            "0B1 0RC1:0:1.**@r0")  # microbatch 1 keeps 2.**: its B follows its F
    reference = toy_run(None)
    result = toy_run(rules, text)
    assert_identical(reference, result, "log")
    router = result[3]
    assert format_actions(router.program.last_log) == text
    assert router.layers_recomputed == 2 and result[2] == [(0, "2#0"), (0, "2#1")]


class Arena:
    """Memory two layers share: the first saves a temporary made in it; the second, once
    that is freed (its swap-out completed: `settle`), makes its own temporary in the same
    memory, as an allocator hands a freed block to the next tensor of its size (CUDA's
    caching allocator does at once). `reuse=False`: each in memory of its own (the
    reference)."""

    def __init__(self, settle: Callable[[], None] = lambda: None, reuse: bool = False) -> None:
        self.settle, self.reuse = settle, reuse
        self.arenas: list[bytearray] = []
        self.freed: list[bool] = []
        self.gone: Callable[[], torch.Tensor | None] = lambda: None

    def tensor(self, x: torch.Tensor, *, second: bool) -> torch.Tensor:
        """A tensor like `x` in new memory, or for the `second` layer with `reuse` in the
        first layer's (each forward's first tensor gets new memory)."""
        if not (second and self.reuse):
            self.arenas.append(bytearray(x.numel() * x.element_size()))
        return torch.frombuffer(self.arenas[-1], dtype=x.dtype).view(x.shape)  # the tensor keeps its arena


class SavesInArena(nn.Module):
    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.arena.tensor(x, second=False)
        y.copy_(x * 2)
        self.arena.gone = weakref.ref(y)
        return y.sin()  # saves y (1#0); only the swap holds it after this layer


class ReusesArena(SavesInArena):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.arena.settle()
        self.arena.freed.append(self.arena.gone() is None)
        w = self.arena.tensor(x, second=True)
        w.copy_(x * 3)
        return x + w.cos()  # saves w (2#0): with reuse, a new storage where y's was


def test_a_storage_made_where_a_swapped_one_was_freed_is_a_new_storage():
    settle: list[Callable[[], None]] = []
    arena = Arena(lambda: settle[0](), reuse=True)
    text = "0F0 0SO0:0:1.**@r0 0F1 0SO1:0:1.**@r0 0SI0:0:1.**@r0 0B0 0SI1:0:1.**@r0 0B1"
    result = toy_run([TensorRule(tensor="1#0", technique="host")], text, middle=lambda: SavesInArena(arena),
                     last=lambda: ReusesArena(arena), on_engine=lambda e: settle.append(e.wait_outs))
    assert arena.freed[-2:] == [True, True]  # in both microbatches y's storage was gone first
    assert result[2] == [(0, "1#0"), (1, "1#0")]
    # w is kept (no rule names it): the backward must see its own values, not y's
    reference = Arena()
    assert_identical(toy_run(None, middle=lambda: SavesInArena(reference), last=lambda: ReusesArena(reference)),
                     result, "reused memory")


# ---- swap-ins where the list puts them; fetched tensors handed over -------------------------------

def test_a_unit_comes_back_when_its_swap_in_is_issued_not_before():
    """The in copies of a unit start when the program issues its SI (here one compute
    action before its backward, as the rewriter places it), last-saved first."""
    u = unit("layers.1")
    text = f"0F0 0SO0:{u} 0F1 0SO1:{u} 0SI0:{u} 0F2 0SO2:{u} 0SI1:{u} 0B0 0SI2:{u} 0B1 0B2"
    events: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def note(what: str, microbatch: int, tensor: str) -> None:
        with lock:
            events.append((what, microbatch, tensor))

    engine = host_engine(fault=lambda key, direction: note(direction, key.microbatch, key.tensor))
    torch.manual_seed(0)
    model = build_stage(CFG, 0, END, seed=5)
    batches = [example_batch(CFG, 2, seed=m) for m in range(NUM_MB)]
    router, program = make_router(model, [TensorRule(tensor="layers.1.**", technique="host")], parse_actions(text),
                                  batches[0][0], engine=engine, end=END)
    program.on(Kind.SI, 0, lambda a: note("SI", a.microbatch, a.tensor) or router.prefetch_unit(a))
    back: dict[str, list[int]] = {}  # compute action -> microbatches brought back when it starts
    begin = program.begin

    def begin_and_settle(action: Action) -> None:
        begin(action)
        engine.wait_idle()  # what the SIs issued so far started has finished
        back[str(action)] = sorted({m for d, m, _t in events if d == "in"})

    program.begin = begin_and_settle
    step(model, router, program, batches)
    assert back == {"0F0": [], "0F1": [], "0F2": [0], "0B0": [0, 1], "0B1": [0, 1, 2], "0B2": [0, 1, 2]}
    for m in range(NUM_MB):
        issued = events.index(("SI", m, u))
        ins = [(i, t) for i, (d, mb, t) in enumerate(events) if d == "in" and mb == m]
        outs = [t for d, mb, t in events if d == "out" and mb == m]
        # the unit's tensors leave as one swap and come back as one, after its SI
        assert outs == [u] and [t for _i, t in ins] == [u] and ins[0][0] > issued
    assert format_actions(program.last_log) == text
    router.close()
    engine.close()


def test_fetched_tensors_die_with_their_backward():
    """The engine hands a fetched tensor over (it keeps a weakref only) and the router
    drops it once its last save was unpacked: after B(m) nothing fetched for microbatch m
    is alive."""
    fetched: dict[int, list[weakref.ref]] = {}
    alive_after: dict[int, list[int]] = {}

    def spy(engine: SwapEngine) -> None:
        fetch = engine.fetch_group

        def fetch_and_note(handle):
            tensors = fetch(handle)
            fetched.setdefault(handle.key.microbatch, []).extend(weakref.ref(t) for t in tensors)
            return tensors

        engine.fetch_group = fetch_and_note

    def after_backward(m: int) -> None:
        alive_after[m] = [sum(r() is not None for r in fetched[k]) for k in sorted(fetched)]

    result = toy_run(HOST_ALL, TOY_PROGRAM, on_engine=spy, after_backward=after_backward)
    assert [len(fetched[m]) for m in (0, 1)] == [4, 4]  # y fetched once for its two saves
    assert alive_after == {0: [0], 1: [0, 0]}
    assert result[4].stats.num_in == 6  # a swap per unit and microbatch, one for the loss's


def _live_run(rules: list[TensorRule], compact: Compact, cfg: ModelConfig = CFG) -> tuple[int, int, SwapEngine]:
    """One step of gpt-tiny (or `cfg`'s model) counted by a `LiveBytes` (the training
    thread and the swap workers): the bytes live once the last forward's copy-outs were
    released, those live after the step, and the engine."""
    live = LiveBytes(rank=0)
    torch.manual_seed(0)
    end = cfg.num_layers + 2
    model = build_stage(cfg, 0, end, seed=5)
    batches = [example_batch(cfg, 2, seed=m) for m in range(NUM_MB)]
    engine = host_engine(watch=live.watch)
    router, program = make_router(model, rules, gpipe(NUM_MB, compact), batches[0][0], engine=engine, end=end)
    after_forwards: list[int] = []

    def released() -> None:
        engine.wait_outs()
        after_forwards.append(live.live_bytes)

    with live.watch():
        step(model, router, program, batches, after_forwards=released)
        after_step = live.live_bytes
    router.close()
    engine.close()
    return after_forwards[0], after_step, engine


def test_swapping_frees_the_swapped_bytes_and_nothing_fetched_outlives_the_step():
    keep_fwd, keep_end, _ = _live_run([TensorRule(tensor="*", technique="keep")], lambda m: [])
    swap_fwd, swap_end, engine = _live_run([TensorRule(tensor="layers.1.**", technique="host")],
                                           lambda m: [(Kind.SO, unit("layers.1"))])
    stats = engine.stats
    assert stats.bytes_out > 0 and stats.bytes_in == stats.bytes_out
    assert keep_fwd - swap_fwd == stats.bytes_out  # each swapped storage left the device
    assert swap_end == keep_end  # the swapped-in tensors died with their backwards


def test_a_dense_view_swapped_with_another_view_of_its_storage_frees_the_storage():
    """Llama's SDPA saves its (B, heads, T, hd) output, a dense but not contiguous view,
    and the output projection saves the (B, T, H) view of the same storage: the second is
    rebuilt over the fetched first (it comes back with its own strides), so swapping the
    layer frees the storage, as the memory model counts it, and nothing stays behind."""
    llama = dataclasses.replace(load_model_config("llama-tiny"), attention="sdpa")
    keep_fwd, keep_end, _ = _live_run([TensorRule(tensor="*", technique="keep")], lambda m: [], llama)
    swap_fwd, swap_end, engine = _live_run([TensorRule(tensor="layers.1.**", technique="host")],
                                           lambda m: [(Kind.SO, unit("layers.1"))], llama)
    assert engine.stats.bytes_out > 0
    assert keep_fwd - swap_fwd == engine.stats.bytes_out  # (before: SDPA's output stayed, 32 KiB a microbatch)
    assert swap_end == keep_end


def _cuda_run(host: bool):
    """GPipe over 4 microbatches on the GPU, every block's tensors host-swapped (or
    kept); returns grads, the peak allocated bytes up to the last forward's release, the
    engine's stats and the pool."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_stage(CFG, 0, END, seed=5, device=device)
    batches = [tuple(t.to(device) for t in example_batch(CFG, 8, seed=m)) for m in range(4)]
    rules = [TensorRule(tensor="layers.*.**", technique="host" if host else "keep")]
    pool = PinnedHostPool(256 << 20)
    engine = SwapEngine(pool, MemoryManager(device, rank=0), device, rank=0, stage=0)
    blocks = [(Kind.SO, unit(f"layers.{i}")) for i in range(CFG.num_layers)]
    router, program = make_router(model, rules, gpipe(4, lambda m: blocks if host else []), batches[0][0],
                                  engine=engine, end=END)
    peak: list[int] = []

    def released() -> None:
        engine.wait_outs()
        torch.cuda.synchronize()
        peak.append(torch.cuda.max_memory_allocated())

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(model, router, program, batches, after_forwards=released)
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    router.close()
    engine.close()
    return grads, peak[0], engine.stats, pool


@pytest.mark.cuda
def test_cuda_host_swap_is_identical_and_lowers_the_peak():
    keep, keep_peak, _, _ = _cuda_run(host=False)
    swap, swap_peak, stats, pool = _cuda_run(host=True)
    for name, g in keep.items():
        assert torch.equal(g, swap[name]), name
    assert stats.bytes_out > 0 and swap_peak < keep_peak
    assert pool.buffer.is_pinned()  # one pinned allocation, no pinning per tensor
