"""The saved-tensor router: carries out, tensor by tensor, what the rank's program says
about a stage's activations.

Around each microbatch's forward (and, on the last stage, the loss computed after it) the
router installs `torch.autograd.graph.saved_tensors_hooks`; a `SavedTensorNamer`
(`mpress.contract.identity`, the naming the profilers use) names each saved tensor, the stage's
`StageRules` (the rewriter's reading of the plan) give the rule deciding it, and the
tensor's *unit* (`mpress.contract.actions.UnitId`: its layer and that rule) is looked up in the
program (`RankProgram.compacted`): only the units the program compacts in this
microbatch are moved, by the action it names there:

- SO / DO: the pack hook adds the tensor to its unit's group and returns its place in
  it; when the layer's forward ends the group goes to the host / D2D swap engine as one
  swap (one placement, one copy batch: host work per unit, not per tensor); the unit's
  SI / DI (`prefetch_unit`, issued by the program where the list puts it) starts the
  copy back; the unpack hook in backward takes the tensor from the fetched group (a
  split backward unpacks it in its I and again in its W: torch's I retains the graph,
  so the fetched tensor stays with the graph until W frees it, as torch's own saves do);
- DR: the layer's forward runs under non-reentrant `torch.utils.checkpoint` (RNG state
  preserved, so dropout masks repeat), whole, or, when the rules recompute only some of
  what it saves, with the operators producing the rest cached (`mpress.contract.selective`); its
  RC is recorded when the backward recomputes it;
- anything else is kept (the pack hook returns the tensor).

Storages, not tensors, take up memory, so a storage saved twice in a microbatch keeps
its first decision (a second save of a swapped storage shares the swap; the fetched
tensor is held until its last save was unpacked), and what something else holds anyway
(the stage's input: torch's receive buffer or the input batch; the loss's targets and
the stage's output; the module's buffers) is never moved: swapping it would free
nothing, as the memory model says. Parameters, and tensors sharing a parameter's
storage, are never moved.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mpress.contract.actions import Action, Kind, UnitId, UnitKind, moves_layer_data
from mpress.errors import PlanError, SwapError
from mpress.contract.identity import SavedName, SavedTensorNamer, StageRules, TensorKey, inspect_stage, layer_paths, storage_key
from mpress.contract.plan import MODEL_DATA_PREFIXES, StagePlan
from mpress.contract.selective import cached_ops, check_closed, run_recomputed
from mpress.runtime.program import RankProgram
from mpress.runtime.swap.engine import SwapEngine, SwapHandle
from mpress.runtime.swap.layout import moved_as_it_lies


class _Group:
    """The tensors of one unit saved in one microbatch, swapped as one (`SwapEngine.
    swap_out_group`: one placement, one copy batch): collected by the pack hook while
    the unit's layer runs, issued when its forward ends (where the emulator starts the
    swap-out), brought back together by the unit's SI / DI."""

    def __init__(self, engine: SwapEngine, key: TensorKey, weights: Any, *, split: bool = False) -> None:
        self.engine = engine
        self.key = key
        self.weights = weights
        self.split = split
        """The microbatch's backward is split: its I and its W each unpack the saves."""
        self.parts: list[tuple[str, torch.Tensor]] | None = []
        """(name, tensor) until issued; then the engine holds them."""
        self.versions: list[int] | None = []
        """Each tensor's version counter when autograd saved it."""
        self.handle: SwapHandle | None = None
        self.fetched: list[torch.Tensor | None] | None = None

    def add(self, name: str, tensor: torch.Tensor) -> int:
        self.parts.append((name, tensor))  # type: ignore[union-attr]
        self.versions.append(tensor._version)
        return len(self.parts) - 1  # type: ignore[arg-type]

    def issue(self) -> None:
        for (name, tensor), version in zip(self.parts, self.versions):  # type: ignore[arg-type]
            if tensor._version != version:
                # torch checks this at backward, but not for tensors its saved-tensor hooks
                # took (saved_variable.cpp): without this the swap would carry the new values
                raise SwapError(f"{self.key}: saved tensor {name} was modified by an inplace operation "
                                f"after autograd saved it (version {version}, now {tensor._version}); "
                                "the backward needs the saved values")
        self.handle = self.engine.swap_out_group(self.key, self.parts, weights=self.weights)  # type: ignore[arg-type]
        self.parts = self.versions = None

    def take(self, index: int) -> torch.Tensor:
        """Tensor `index` back on the device (the group is fetched on the first take); the
        group keeps no reference to it after (its saves hold it as long as they need)."""
        if self.fetched is None:
            self.fetched = list(self.engine.fetch_group(self.handle))  # type: ignore[arg-type]
        tensor = self.fetched[index]
        if tensor is None:
            raise SwapError(f"{self.key}: tensor {index} of the group was taken twice")
        self.fetched[index] = None
        return tensor


class _Swapped:
    """What the autograd graph holds instead of a swapped-out storage (one per storage,
    shared by every save of it in the microbatch): its place in its unit's group."""

    def __init__(self, group: _Group, index: int, tensor: torch.Tensor) -> None:
        self.group = group
        self.index = index
        self.view = _view_of(tensor)
        self.as_it_lies = moved_as_it_lies(tensor)
        """It comes back in its own layout, so other views of its range can be rebuilt
        over it (a dense one, SDPA's (B, heads, T, hd) output, as well as a contiguous one)."""
        self.uses = 1
        """Saves of the storage not unpacked yet."""
        self.tensor: torch.Tensor | None = None
        """The fetched tensor while later saves still need it."""

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (a view of the same storage) lies within the swapped elements,
        so it can be rebuilt from the fetched tensor."""
        _size, _stride, offset, dtype, conj, neg = self.view
        if (not self.as_it_lies or tensor.dtype != dtype or any(st < 0 for st in tensor.stride())
                or conj or neg or tensor.is_conj() or tensor.is_neg()):
            return False  # a conjugate or negative view is not its storage's values
        last = tensor.storage_offset() + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
        numel = 1
        for n in self.view[0]:
            numel *= n
        return offset <= tensor.storage_offset() and (tensor.numel() == 0 or last < offset + numel)

    def unpack(self) -> torch.Tensor:
        tensor = self.tensor if self.tensor is not None else self.group.take(self.index)
        self.uses -= 1
        # a split backward's W unpacks again what its I did (torch's I keeps the graph):
        # the fetched tensor then lives as long as the graph holds this save
        self.tensor = tensor if self.uses > 0 or self.group.split else None
        return tensor


class _View:
    """Another view of a swapped storage: rebuilt over the fetched tensor."""

    def __init__(self, base: _Swapped, tensor: torch.Tensor) -> None:
        self.base = base
        self.size, self.stride = tuple(tensor.shape), tuple(tensor.stride())
        self.offset = tensor.storage_offset() - base.view[2]
        base.uses += 1

    def unpack(self) -> torch.Tensor:
        return self.base.unpack().as_strided(self.size, self.stride, self.offset)


class _Entry(weakref.ref):
    """The router's entry for one saved storage: a weak reference to the storage, whose
    callback ends the entry when the storage dies, carrying the decision for it (one
    object per saved tensor)."""

    __slots__ = ("decision", "key")
    decision: _Swapped | None
    """Its swap, or None: kept."""
    key: tuple[torch.device, int]
    """Its `storage_key`."""


def _view_of(t: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int, torch.dtype, bool, bool]:
    """What makes two saves of one storage the same tensor: the view and its lazy conjugate
    and negative bits (`x` and `x.conj()` share a storage, not their values)."""
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.is_conj(), t.is_neg()


class SavedTensorRouter:
    """Routes one stage's saved tensors as its rank's program says.

    module: the stage module (module paths as in the whole model).
    plan: this stage's part of the plan; program: the rank's program.
    example_args: one microbatch's input (positional), as the pipeline passes it; the
        router inspects one forward of it (nothing of it remains) when the plan has rules
        about activations.
    layers: the stage's layer list when the caller has it (default: `layer_paths`).
    engine / d2d_engine: the host / D2D swap engines (needed when the plan uses them).
    num_microbatches: when given, the rules' microbatch selectors are checked against it.
    """

    def __init__(self, module: nn.Module, plan: StagePlan, program: RankProgram, *, rank: int,
                 example_args: tuple[Any, ...], layers: list[str] | None = None,
                 engine: SwapEngine | None = None, d2d_engine: SwapEngine | None = None,
                 num_microbatches: int | None = None) -> None:
        self.module = module
        self.plan = plan
        self.program = program
        self.engine = engine
        self.d2d_engine = d2d_engine
        self.rank = rank
        self.stage = plan.stage
        self._check_plan()
        self._active = False
        self._microbatch = -1
        self._split_now = False  # the microbatch's backward is split into I and W
        self._units: dict[str, Kind] = {}
        self._dropped: dict[str, str] = {}    # layer -> its DR unit, this microbatch
        self._saved: dict[tuple[torch.device, int], _Entry] = {}
        """Storage (device, address) -> its entry (its swap, or None: kept), for the storages
        alive that this microbatch saved or holds; a storage's entry goes when it dies, so a
        new storage at a freed address is a new storage."""
        self._saved_lock = threading.Lock()
        self._forget_entry = self._forget  # one bound method, the callback of every entry
        self._routes: dict[int, dict[SavedName, tuple[str, int | None, str | None]]] = {}
        """Per microbatch: a saved tensor's name -> (its id, the index of the rule deciding it,
        its unit): what the namer's name says is the same in every step, so read once."""
        self._routes_now: dict[SavedName, tuple[str, int | None, str | None]] = {}
        self._pending: dict[tuple[int, str], list[_Group]] = {}  # (microbatch, unit) -> swaps to bring back
        self._open: dict[str, _Group] = {}  # unit -> its group collecting tensors now
        self._unit_names: dict[tuple[int, int], str] = {}  # (layer index, rule) -> unit
        self.tensors_swapped = 0
        self.layers_recomputed = 0
        # No rule about activations (a keep-all plan, or model data only): no hooks at
        # all, so such a plan costs nothing over plain pipelining.
        self.routing = any(not r.tensor.startswith(MODEL_DATA_PREFIXES) for r in plan.rules)
        self._originals: dict[str, Callable[..., Any]] = {}
        self.namer: SavedTensorNamer | None = None
        self._input_hook = None
        paths = layers if layers is not None else layer_paths(module, example_args)
        if not self.routing:
            self.layers = {name: module.get_submodule(name) for name in paths}
            self.rules = StageRules(plan, [], num_microbatches)
            return
        tensors = inspect_stage(module, example_args, paths)
        self.layers = {layer.name: module.get_submodule(layer.name) for layer in tensors}
        self.layer_names = list(self.layers)
        self.rules = StageRules(plan, tensors, num_microbatches)
        self._tensors = {layer.name: (i, layer) for i, layer in enumerate(tensors)}  # name -> (index, tensors)
        self._cached: dict[tuple[str, int], frozenset[int]] = {}  # (layer, microbatch) -> cached ops
        for m in range(num_microbatches or 0):  # a set the checkpoint cannot recompute: refused now
            for name in self.layer_names:
                if self._cached_ops(name, m) and self.stage > 0 and program.split(self.stage, m):
                    # torch's selective checkpoint serves each cached output once; a split
                    # backward replays the layer in its I and again in its W
                    raise PlanError(f"stage {self.stage} microbatch {m} layer {name}: the plan recomputes part of "
                                    "the layer, which a split backward (I and W) cannot run: recompute it whole")
        self.namer = SavedTensorNamer(module, self.layer_names)
        self._buffers = list(module.buffers())  # the module holds them
        self._input_hook = module.register_forward_pre_hook(self._stage_input)
        for name, layer in self.layers.items():
            self._originals[name] = layer.forward
            layer.forward = functools.partial(self._layer_forward, name)  # instance override keeps paths

    def _check_plan(self) -> None:
        """Every swap the program lists for this stage has an engine to run it."""
        for action in self.program.actions:
            if action.stage != self.stage or moves_layer_data(action):  # (the stage's layer data: not a swap)
                continue
            if action.kind is Kind.SO and self.engine is None:
                raise PlanError(f"stage {self.stage}: the program host-swaps ({action}) but no swap engine runs "
                                "(the plan pins no host memory for it: pinned_host_bytes is 0)")
            if action.kind is Kind.DO and self.d2d_engine is None:
                raise PlanError(f"stage {self.stage}: the program D2D-swaps ({action}) but no peer pools were "
                                "set up (call mpress.d2d.runtime.peer_pool.setup_peer_pools on every rank and pass "
                                "them to wrap_stage as peers)")

    # -- hooks --------------------------------------------------------------------------------
    def _stage_input(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._active:
            self._keep_storages(args)  # held by the pipeline

    def _keep_storages(self, values: Any) -> None:
        """Never move these tensors' storages in this microbatch (something else holds them)."""
        for t in values:
            if isinstance(t, torch.Tensor) and storage_key(t) not in self._saved:
                self._remember(t, None)

    def _remember(self, tensor: torch.Tensor, decision: _Swapped | None,
                  key: tuple[torch.device, int] | None = None, storage: Any = None) -> None:
        """`decision` holds for `tensor`'s storage (`key`: its `storage_key`, `storage`: the
        storage, when the caller has them) while it lives."""
        # the entry is the weak reference whose callback ends it when the storage dies
        # (a `weakref.finalize` would cost several times more per saved tensor)
        entry = _Entry(tensor.untyped_storage() if storage is None else storage, self._forget_entry)
        entry.key = storage_key(tensor) if key is None else key
        entry.decision = decision
        with self._saved_lock:
            self._saved[entry.key] = entry

    def _forget(self, entry: _Entry) -> None:
        """A storage died (on any thread): its address may hold a new storage next."""
        with self._saved_lock:
            if self._saved.get(entry.key) is entry:
                del self._saved[entry.key]

    def _layer_forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        forward = self._originals[name]
        unit = self._dropped.get(name) if self._active else None
        if unit is None:
            out = forward(*args, **kwargs)
            if self._open:
                self._issue_groups()  # the layer's forward ended: its swap-outs start
            return out
        microbatch = self._microbatch
        self.program.record(Action(self.stage, Kind.DR, microbatch, unit))
        self.layers_recomputed += 1
        runs = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal runs
            runs += 1
            if runs == 2:  # the backward recomputes the layer
                self.program.record(Action(self.stage, Kind.RC, microbatch, unit))
            return forward(*a, **k)

        layer = self._tensors[name][1]
        try:
            out = run_recomputed(run, layer.ops, self._cached_ops(name, microbatch), *args, **kwargs)
        except PlanError as exc:  # the forward left its trace: name where
            raise PlanError(f"stage {self.stage} microbatch {microbatch} layer {name}: {exc}") from None
        if self._open:
            self._issue_groups()  # as after any layer's forward
        return out

    def _cached_ops(self, name: str, microbatch: int) -> frozenset[int]:
        """The operators of layer `name` whose outputs its checkpoint caches in `microbatch`
        (`mpress.contract.selective`: empty when the rules recompute all it saves); `PlanError` when
        the rules recompute a set the checkpoint cannot recompute alone."""
        found = self._cached.get((name, microbatch))
        if found is None:
            li, layer = self._tensors[name]
            recomputed = self.rules.recompute_set(li, microbatch)
            if recomputed and layer.ops is not None:
                where = f"stage {self.stage} microbatch {microbatch}"
                recomputed = check_closed(layer.ops, recomputed, layer.saved, where)
                found = cached_ops(layer.ops, recomputed)
            else:
                found = frozenset()
            self._cached[(name, microbatch)] = found
        return found

    def _pack(self, tensor: torch.Tensor) -> Any:
        packed = self._decide(tensor)
        if self._split_now and packed is tensor and tensor.grad_fn is not None:
            # a tensor saved by the node that made it would hold that node, which holds
            # the save: a cycle that only running the node breaks, and a split backward's
            # I runs nodes keeping the graph (W never runs them again), so the tensor
            # would outlive the microbatch. Its detached alias holds no node.
            return tensor.detach()
        return packed

    def _decide(self, tensor: torch.Tensor) -> Any:
        """What the graph saves for `tensor` (it, or its swap)."""
        if not self._active:  # (active only when routing: the namer exists)
            return tensor
        storage = tensor.untyped_storage()
        skey = (tensor.device, storage.data_ptr())  # `storage_key`, with the storage kept for `_remember`
        name = self.namer.name(tensor, skey)  # type: ignore[union-attr]
        if name is None:  # a parameter's storage: never moved
            return tensor
        entry = self._saved.get(skey)  # (a dict read is atomic: no lock)
        if entry is not None:  # saved before in this microbatch: its first decision holds
            swapped = entry.decision
            if swapped is None:
                return tensor
            if swapped.view == _view_of(tensor):
                swapped.uses += 1
                return swapped
            # another view of a swapped storage: rebuilt from the fetched tensor where it
            # can be; else kept (the storage stays, as the profile's alias entry says)
            return _View(swapped, tensor) if swapped.covers(tensor) else tensor
        route = self._routes_now.get(name)
        if route is None:
            route = self._routes_now[name] = self._route(name)
        tid, rule, unit = route
        kind = self._units.get(unit) if unit is not None else None
        engine = self.engine if kind is Kind.SO else self.d2d_engine if kind is Kind.DO else None
        if engine is None or skey[0] != engine.device:
            # kept, or recomputed (saved outside its checkpoint: the loss's), or not in the
            # device's memory at all (a CPU scalar a user's forward made): nothing to move
            self._remember(tensor, None, skey, storage)
            return tensor
        group = self._open.get(unit)  # type: ignore[arg-type]
        if group is None:
            group = self._open_group(engine, kind, rule, unit)  # type: ignore[arg-type]
        swapped = _Swapped(group, group.add(tid, tensor), tensor)
        self._remember(tensor, swapped, skey, storage)
        self.tensors_swapped += 1
        return swapped

    def _route(self, name: SavedName) -> tuple[str, int | None, str | None]:
        """(id, index of the deciding rule or None, unit or None) of the tensor `name`
        names in this microbatch."""
        tid = name.id
        rule = self.rules.rule_index(tid, self._microbatch)
        return tid, rule, None if rule is None else self._unit_name(name.layer, rule)

    def _open_group(self, engine: SwapEngine, kind: Kind, rule: int, unit: str) -> _Group:
        """A new group collecting `unit`'s tensors for `engine` (the unit's first, or its
        tensors saved after its group was issued)."""
        groups = self._pending.setdefault((self._microbatch, unit), [])
        if not groups:
            self.program.record(Action(self.stage, kind, self._microbatch, unit))
        stripes = self.plan.rules[rule].stripes
        weights = tuple((s.device, s.fraction) for s in stripes) or None
        # a unit's tensors saved after its group was issued (after its layer's
        # forward) form another group: another key
        tkey = TensorKey(rank=self.rank, stage=self.stage, microbatch=self._microbatch,
                         tensor=unit if not groups else f"{unit}/{len(groups)}")
        group = self._open[unit] = _Group(engine, tkey, weights,
                                          split=self.program.split(self.stage, self._microbatch))
        groups.append(group)
        return group

    def _unit_name(self, layer: int, rule: int) -> str:
        """The unit (string form) of layer `layer`'s tensors under rule `rule`."""
        found = self._unit_names.get((layer, rule))
        if found is None:
            found = self._unit_names[(layer, rule)] = str(
                UnitId(self.stage, UnitKind.ACTIVATIONS, layer=self.layer_names[layer], rule=rule))
        return found

    def _issue_groups(self) -> None:
        """Start the swap-outs of the groups collected so far (a layer's forward ended)."""
        groups, self._open = list(self._open.values()), {}
        for group in groups:
            group.issue()

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, (_Swapped, _View)) else packed

    # -- per microbatch ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def microbatch(self, microbatch: int) -> Iterator[None]:
        """Route the saved tensors of `microbatch`'s forward (use around the forward)."""
        if not self.routing:
            yield
            return
        self._units = self.program.compacted(self.stage, microbatch)
        self._split_now = self.program.split(self.stage, microbatch)
        self._dropped = {UnitId.parse(u).layer: u for u, k in self._units.items() if k is Kind.DR}  # type: ignore[misc]
        with self._saved_lock:
            self._saved = {}
        self._routes_now = self._routes.setdefault(microbatch, {})
        self._keep_storages(self._buffers)
        self.namer.begin()
        self._microbatch = microbatch
        with self._routing():
            yield

    @contextlib.contextmanager
    def _routing(self) -> Iterator[None]:
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
            self._issue_groups()  # what was saved after the last layer (the loss's)
        finally:
            self._active = False
            self._open = {}

    def route_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn` with its saved tensors routed as part of the last forward's microbatch
        (torch computes the loss right after the last stage's forward, outside it); the
        profilers count them toward the stage's last layer, and so does the namer."""
        if not self.routing:
            return loss_fn

        def routed(*args: Any, **kwargs: Any) -> torch.Tensor:
            # the stage's output (the pipeline holds it) and the targets (a view of the
            # iteration's) are held anyway: never moved
            self._keep_storages([*args, *kwargs.values()])
            with self._routing():
                return loss_fn(*args, **kwargs)

        return routed

    def prefetch_unit(self, action: Action) -> None:
        """Start bringing back every tensor of the unit `action` (an SI or DI) names, the
        last-saved first (the backward needs it first; each engine copies in the order it
        is asked)."""
        for group in reversed(self._pending.pop((action.microbatch, action.tensor), ())):  # type: ignore[arg-type]
            group.engine.prefetch(group.handle)

    def finish(self, microbatch: int) -> None:
        """After `microbatch`'s backward: give up swaps the program never brought back."""
        for key in [k for k in self._pending if k[0] == microbatch]:
            for group in self._pending.pop(key):
                group.engine.discard(group.handle)

    def close(self) -> None:
        """Remove the hooks and restore the layers' forwards."""
        if self.namer is not None:
            self.namer.close()
        if self._input_hook is not None:
            self._input_hook.remove()
        for name in self._originals:
            del self.layers[name].forward  # the class's forward shows through again
        self._originals.clear()
