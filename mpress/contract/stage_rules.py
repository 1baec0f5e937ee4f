"""A stage's rules read for its layers (`StageRules`): the one reading of a plan's rules
both halves use, at plan time from the profile's saved tensors and at run time from
`identity.inspect_stage`'s, so a rule means at run time what it meant when it was planned.

The first rule of a stage whose pattern names a tensor and whose microbatch selector
holds the microbatch decides it; no rule = keep. A layer whose rules recompute all its
saved tensors in a microbatch is checkpointed whole; one whose rules recompute some of
them is checkpointed with the operators producing the rest cached
(`mpress.contract.selective`), so the rest is kept: no other rule may move them.

Tensor names are those of `mpress.contract.identity` (`module#index`, `optim:LAYER`,
`stash:LAYER`). Nothing here needs torch: the planner reads rules without loading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpress.config.vocabulary import Technique
from mpress.contract.plan import (
    StagePlan,
    TensorRule,
    is_exact_pattern,
    parse_microbatches,
    pattern_matches,
    plain_module_prefix,
)
from mpress.errors import PlanError

if TYPE_CHECKING:
    from mpress.contract.selective import LayerOps

MODEL_DATA_KINDS = ("optim", "stash", "param", "grad")
"""Prefixes of model-data names in rules: `optim:LAYER`, `stash:LAYER`, `param:LAYER`,
`grad:LAYER`."""


@dataclass(frozen=True)
class LayerTensors:
    """One layer and the ids of the tensors it saves for backward, in saving order."""

    name: str
    saved: tuple[str, ...]
    ops: LayerOps | None = None
    """Its forward's operators and the producer of each saved tensor (`inspect_stage`
    traces them at run time; None where only the names are known)."""


class StageRules:
    """A stage's rules, read for its layers: the one reading both halves use.

    layers: the stage's layers with the ids of their saved tensors (from the profile at
    plan time, `inspect_stage` at run time). num_microbatches: when given, selectors are
    checked against it.
    """

    def __init__(self, plan: StagePlan, layers: Sequence[LayerTensors], num_microbatches: int | None = None) -> None:
        self.plan = plan
        self.rules = plan.rules
        self.layers = list(layers)
        if num_microbatches is not None:
            for rule in self.rules:
                parse_microbatches(rule.microbatches, num_microbatches)
        self._candidates: dict[str, tuple[int, ...]] = {}
        self._by_module: dict[str, list[int]] = {}
        """Rules `X.**` with a plain module path X (the planner writes only these), by X."""
        self._exact: dict[str, list[int]] = {}
        """Rules naming one tensor (`layers.3.mlp.act#0`, `optim:layers.3`), by that name."""
        self._globs: list[int] = []
        """The other rules, matched one by one."""
        for i, r in enumerate(self.rules):
            prefix = plain_module_prefix(r.tensor)
            if prefix is not None:
                self._by_module.setdefault(prefix, []).append(i)
            elif is_exact_pattern(r.tensor):
                self._exact.setdefault(r.tensor, []).append(i)
            else:
                self._globs.append(i)
        self._groups: dict[tuple[int, tuple[int, ...]], dict[int, list[int]]] = {}
        """`layer_groups` answers by (layer, the rules selecting the microbatch): microbatches
        that the same rules select group a layer's tensors alike, and the rules never change."""
        self._selecting: dict[int, tuple[int, ...]] = {}
        self._layer_index = {layer.name: i for i, layer in enumerate(self.layers)}

    def candidates(self, tensor: str) -> tuple[int, ...]:
        """Indices of the rules whose pattern names `tensor` (any microbatch), in order."""
        found = self._candidates.get(tensor)
        if found is None:
            found = self._candidates[tensor] = self._match(tensor)
        return found

    def _match(self, tensor: str) -> tuple[int, ...]:
        """`candidates` worked out: a plain `X.**` rule names an activation of module X or
        of a module under X (never model data), so only the module's own path and its
        ancestors are looked up, and a rule naming one tensor only that name; glob rules
        are matched one by one."""
        hits = [i for i in self._globs if pattern_matches(self.rules[i].tensor, tensor)]
        hits.extend(self._exact.get(tensor, ()))
        if ":" not in tensor and self._by_module:
            parts = tensor.split("#", 1)[0].split(".")
            for n in range(1, len(parts) + 1):
                hits.extend(self._by_module.get(".".join(parts[:n]), ()))
        return tuple(sorted(hits))

    def rule_index(self, tensor: str, microbatch: int | None) -> int | None:
        """The index of the rule deciding `tensor` in `microbatch`, or None (keep)."""
        for i in self.candidates(tensor):
            if self.rules[i].selects(microbatch):
                return i
        return None

    def rule(self, tensor: str, microbatch: int | None) -> TensorRule | None:
        """The rule deciding `tensor` in `microbatch`, or None (keep)."""
        i = self.rule_index(tensor, microbatch)
        return None if i is None else self.rules[i]

    def technique(self, tensor: str, microbatch: int | None) -> Technique:
        rule = self.rule(tensor, microbatch)
        return Technique.KEEP if rule is None else rule.technique

    def selecting(self, microbatch: int) -> tuple[int, ...]:
        """Indices of the rules that apply in `microbatch`: microbatches with the same
        ones are decided alike."""
        found = self._selecting.get(microbatch)
        if found is None:
            found = self._selecting[microbatch] = tuple(i for i, r in enumerate(self.rules) if r.selects(microbatch))
        return found

    def layer_groups(self, layer: int, microbatch: int) -> dict[int, list[int]]:
        """Layer `layer`'s saved tensors that a rule compacts in `microbatch`: rule index ->
        positions in the layer's saving order. Raises `PlanError` when the layer is
        recomputed in part and a rule moves some of the rest (a layer recomputed in part
        keeps what it does not recompute: its checkpoint caches it). The answer is shared
        between calls: do not change it."""
        selecting = self.selecting(microbatch)
        found = self._groups.get((layer, selecting))
        if found is not None:
            return found
        groups: dict[int, list[int]] = {}
        saved = self.layers[layer].saved
        for position, tensor in enumerate(saved):
            r = self.rule_index(tensor, microbatch)
            if r is not None and self.rules[r].technique is not Technique.KEEP:
                groups.setdefault(r, []).append(position)
        techniques = {self.rules[r].technique for r in groups}
        if Technique.RECOMPUTE in techniques and len(techniques) > 1:
            recomputed = sum(len(p) for r, p in groups.items() if self.rules[r].technique is Technique.RECOMPUTE)
            moved = next(r for r in groups if self.rules[r].technique is not Technique.RECOMPUTE)
            name = self.layers[layer].name
            raise PlanError(
                f"stage {self.plan.stage} microbatch {microbatch}: {recomputed} of {len(saved)} saved tensors of "
                f"{name} are recomputed and rule {moved} ({self.rules[moved].tensor}) moves others; a layer "
                f"recomputed in part keeps the rest (recompute all of {name}.** or move none of it)")
        self._groups[(layer, selecting)] = groups
        return groups

    def recompute_set(self, layer: int, microbatch: int) -> frozenset[int]:
        """Positions of layer `layer`'s saved tensors its rules recompute in `microbatch`."""
        groups = self.layer_groups(layer, microbatch)
        return frozenset(p for r, positions in groups.items() if self.rules[r].technique is Technique.RECOMPUTE
                         for p in positions)

    def recomputed(self, layer: int, microbatch: int) -> bool:
        """Whether layer `layer` is recomputed, whole or in part, in `microbatch`."""
        return bool(self.recompute_set(layer, microbatch))

    def model_data_rule(self, kind: str, layer: str, microbatch: int | None = None) -> tuple[int, TensorRule] | None:
        """The rule that moves layer `layer`'s model data of `kind` (`optim`: Adam states
        and master weights; `stash`: stashed weight versions) in `microbatch` (None: any),
        as (index, rule); None when it stays on the device."""
        if kind not in MODEL_DATA_KINDS:
            raise PlanError(f"model data is one of {', '.join(MODEL_DATA_KINDS)}, not {kind!r}")
        i = self.rule_index(f"{kind}:{layer}", microbatch)
        if i is None or self.rules[i].technique is Technique.KEEP:
            return None
        return i, self.rules[i]

    def layer_index(self, name: str) -> int:
        index = self._layer_index.get(name)
        if index is None:
            raise PlanError(f"stage {self.plan.stage} has no layer {name!r} "
                            f"(its layers: {', '.join(x.name for x in self.layers)})")
        return index
