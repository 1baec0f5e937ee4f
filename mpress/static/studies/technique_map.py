"""A plan as a stage x layer map: which technique each layer's saved tensors get on its
stage (keep, recompute, host swap, D2D swap) and where its optimizer state goes (kept
on the device, or offloaded to the host or to peers), read with the one reading of a
plan's rules both halves share (`mpress.contract.identity.StageRules`), and drawn as a PNG.

A layer whose saved tensors are decided differently (by tensor or microbatch) shows the
technique of most of its bytes over the iteration's microbatches, and is marked mixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from matplotlib.colors import ListedColormap

from mpress.contract.stage_rules import StageRules
from mpress.contract.plan import Plan
from mpress.static.plan.evaluate import PipelineSetup
from mpress.static.studies.plots import new_figure, save
from mpress.static.plan.rewriter import layer_tensors
from mpress.config.vocabulary import Technique

TECHNIQUES = (Technique.KEEP, Technique.RECOMPUTE, Technique.HOST, Technique.D2D)
_COLORS = ("#d9d9d9", "#4c9be8", "#f0a030", "#3cb371")


@dataclass(frozen=True)
class Cell:
    """One layer of one stage in the map."""

    technique: Technique
    """What most of its saved bytes get."""
    mixed: bool
    """Some of its saved bytes get another technique."""
    optimizer: Technique
    """Where its optimizer state goes: keep (on the device), host or d2d."""


@dataclass(frozen=True)
class TechniqueMap:
    layer_names: list[str]
    """Every layer of the model, in order (the map's columns)."""
    cells: list[dict[int, Cell]]
    """Per stage (the map's rows): layer index -> its cell, for the layers it holds."""


def technique_map(plan: Plan, setup: PipelineSetup) -> TechniqueMap:
    """The map of `plan` on the pipeline `setup` describes (its profile's saved tensors)."""
    names = setup.profile.layer_names()
    num_mb = plan.num_microbatches
    cells: list[dict[int, Cell]] = []
    for sp, costs, (start, _end) in zip(plan.stages, setup.costs, setup.ranges):
        rules = StageRules(sp, layer_tensors(costs), num_mb)
        row: dict[int, Cell] = {}
        for j, layer in enumerate(costs.layers):
            by_technique: dict[Technique, int] = {}
            for t in layer.saved:
                for mb in range(num_mb):
                    tech = rules.technique(t.id, mb)
                    by_technique[tech] = by_technique.get(tech, 0) + t.bytes
            main = max(by_technique, key=lambda k: (by_technique[k], k == Technique.KEEP)) if by_technique \
                else Technique.KEEP
            optim = rules.model_data_rule("optim", layer.name)
            row[start + j] = Cell(technique=main, mixed=sum(1 for v in by_technique.values() if v) > 1,
                                  optimizer=Technique.KEEP if optim is None else optim[1].technique)
        cells.append(row)
    return TechniqueMap(layer_names=names, cells=cells)


def plot_technique_map(tmap: TechniqueMap, path: str | Path, title: str) -> Path:
    """The map as a PNG: a row per stage, a column per layer, coloured by technique;
    "*" marks a mixed layer, "O" one whose optimizer state is offloaded ("OH" host,
    "OD" peers, "ON" the local drive)."""
    num_stages, num_layers = len(tmap.cells), len(tmap.layer_names)
    grid = [[-1.0] * num_layers for _ in range(num_stages)]
    fig = new_figure(max(6.0, 0.28 * num_layers + 3), max(3.0, 0.45 * num_stages + 2))
    ax = fig.add_subplot(1, 1, 1)
    for s, row in enumerate(tmap.cells):
        for j, cell in row.items():
            grid[s][j] = TECHNIQUES.index(cell.technique)
            mark = ("*" if cell.mixed else "") + {Technique.HOST: "OH", Technique.D2D: "OD",
                                                          Technique.NVME: "ON"}.get(cell.optimizer, "")
            if mark:
                ax.text(j, s, mark, ha="center", va="center", fontsize=6)
    cmap = ListedColormap(["white", *_COLORS])
    ax.imshow([[v + 1 for v in r] for r in grid], cmap=cmap, vmin=0, vmax=len(TECHNIQUES), aspect="auto",
              interpolation="nearest")
    step = max(1, num_layers // 40)
    ax.set_xticks(range(0, num_layers, step), tmap.layer_names[::step], rotation=90, fontsize=6)
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("layer")
    handles = [ax.bar(0, 0, color=c, label=str(t)) for t, c in zip(TECHNIQUES, _COLORS)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
              title="saved tensors\n(OH/OD/ON: optimizer\nstate on host/peers/drive;\n*: mixed)")
    ax.set_title(title)
    return save(fig, path)
