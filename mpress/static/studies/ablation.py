"""Ablations of a D2D plan: what each of MPress's D2D ingredients is worth here.

Each variant takes the plan's own draft (`PlanResult.draft`), changes one ingredient and
emulates it again, with the planner's own code for everything else:

- **without D2D**: every unit the plan swaps to peers goes to pinned host memory instead
  (same units, same prefetch points);
- **identity mapping**: stage s on device s (no topology-aware device mapping); the best
  use of spare peer memory under that mapping is still found (`assign_spare`), and what
  no peer can take stays on its device;
- **one peer per stage**: no striping; each stage's D2D bytes go to its largest stripe's
  peer, as far as that peer's spare memory reaches (the rest stays on the device).

A variant that no longer fits its devices is reported as such: its slowdown then is not
one the hardware would run. Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.static.plan.evaluate import Evaluation, PipelineSetup
from mpress.static.plan.plan_draft import D2D, HOST, Draft
from mpress.static.plan.planner import PlannerOptions, PlanResult, _Planner
from mpress.config.vocabulary import Strategy


@dataclass(frozen=True)
class Ablation:
    """One variant of a plan and its emulation."""

    name: str
    draft: Draft
    """The plan's draft with the ingredient taken away."""
    evaluation: Evaluation

    @property
    def unplaced_bytes(self) -> int:
        """D2D bytes no peer could take under this variant (they stay on their device)."""
        return self.draft.unplaced_bytes

    @property
    def iteration_s(self) -> float:
        return self.evaluation.result.iteration_s

    @property
    def fits(self) -> bool:
        return self.evaluation.result.fits


def _without_d2d(d: Draft) -> Draft:
    out = d.copy()
    out.layer_tech = [[[HOST if t == D2D else t for t in mbs] for mbs in st] for st in out.layer_tech]
    out.optim = [HOST if t == D2D else t for t in out.optim]
    out.stash = [HOST if t == D2D else t for t in out.stash]
    out.stripes, out.pool_bytes, out.quotas = [()] * len(out.optim), {}, [()] * len(out.optim)
    out.unplaced_bytes = 0
    return out


def ablate(setup: PipelineSetup, result: PlanResult, options: PlannerOptions | None = None) -> list[Ablation]:
    """The variants of `result`'s plan (see the module docstring); none when it swaps
    nothing to peers."""
    d = result.draft
    planner = _Planner(setup, Strategy.MPRESS, options or PlannerOptions(), None)
    n = setup.schedule.num_stages
    if d is None or not any(planner._d2d_bytes(d, s) for s in range(n)):
        return []
    host = _without_d2d(d)
    host_ev = planner.evaluate(host)
    # each stage's peak without its D2D data: what its device can lend (as the D2D rounds see it)
    peaks = [host_ev.result.peak_bytes[d.stage_to_device[s]] for s in range(n)]
    identity = d.copy()
    planner._map_d2d(identity, peaks, mapping=list(range(n)))
    one = d.copy()
    planner._map_d2d(one, peaks, mapping=list(d.stage_to_device), one_peer=True)
    return [Ablation("without D2D (host swap instead)", host, host_ev),
            Ablation("identity device mapping", identity, planner.evaluate(identity)),
            Ablation("one peer per stage (no striping)", one, planner.evaluate(one))]
