"""A plan under construction (`Draft`, the planner's working state) and how it becomes a
`Plan`: one rule per layer and technique, with the microbatches it applies to, plus the
pools each stage reserves.

Units: bytes, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mpress.contract.actions import format_actions
from mpress.hardware.server import Hardware
from mpress.contract.plan import (
    Plan,
    StagePlan,
    Stripe,
    TensorRule,
    format_microbatches,
    hardware_fingerprint,
)
from mpress.static.emulate.host_memory import pinned_bytes
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.memory.stage_memory import WHOLE
from mpress.static.plan.evaluate import Evaluation, PipelineSetup, profile_fingerprint
from mpress.static.plan.plan_eval import with_peer_quotas
from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.config.vocabulary import Strategy, SwapInPolicy, Technique

KEEP, RECOMPUTE, HOST, D2D = Technique.KEEP, Technique.RECOMPUTE, Technique.HOST, Technique.D2D


QUOTA_SLACK = 1.02
QUOTA_SLACK_BYTES = 32 << 10
"""A peer quota holds the mapper's bytes plus this slack: the runtime rounds every stripe
up to the pools' alignment (`ALIGNMENT_BYTES`), and spreads small tensors whole over the peers."""


def peer_quota_bytes(nbytes: float) -> int:
    """The quota (whole `ALIGNMENT_BYTES` units) an exporter gets for `nbytes` of D2D data."""
    return round_up(math.ceil(nbytes * QUOTA_SLACK + QUOTA_SLACK_BYTES))


def quota_payload_bytes(pool_bytes: int, num_quotas: int = 1) -> int:
    """The most D2D data whose quotas (`peer_quota_bytes`, one per exporter: `num_quotas`
    of them) fit in `pool_bytes` together: what the mapper may place on a lender that has
    `pool_bytes` to spare. Bytes, >= 0."""
    slack = max(1, num_quotas) * (QUOTA_SLACK_BYTES + ALIGNMENT_BYTES)
    return max(0, math.floor((pool_bytes - slack) / QUOTA_SLACK))


@dataclass
class Draft:
    """A plan under construction: a technique per (stage, layer, microbatch)."""

    layer_tech: list[list[list[Technique]]]
    """[stage][layer within stage][microbatch] -> keep | host | recompute | d2d."""
    optim: list[Technique]
    """Per stage: keep | host | d2d | nvme for optimizer states + master weights."""
    stash: list[Technique]
    """Per stage: keep | host | d2d for stashed weight versions (PipeDream)."""
    stage_to_device: list[int]
    stripes: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    """Per stage: D2D stripes (peer device, fraction) shared by its D2D units."""
    pool_bytes: dict[int, int] = field(default_factory=dict)
    """Per device: peer pool reserved for D2D exporters."""
    quotas: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    """Per stage: (peer device, bytes) of each peer pool it may fill."""
    unplaced_bytes: int = 0
    """D2D bytes no peer could take (the plan then does not fit)."""
    unplaced_why: str = ""
    """Why they could not go to peers, when it is not a lack of spare peer memory."""
    recompute_choice: dict[tuple[int, int], int] = field(default_factory=dict)
    """(stage, layer) -> the recompute choice of its recomputed microbatches
    (`stage_memory.Choice`: an entry of the layer's `recompute_options`); absent: `WHOLE`."""
    params: list[set[int]] = field(default_factory=list)
    """Per stage: layers whose working parameters live on the host (`param:` rules)."""
    grads: list[set[int]] = field(default_factory=list)
    """Per stage: layers whose gradients go to the host (`grad:` rules)."""
    host_step: list[bool] = field(default_factory=list)
    """Per stage: whether it steps its optimizer on the host (a stage with `params` or
    `grads` must)."""
    drive_full: bool = False
    """The local drive could not take optimizer data the pins needed moved (`planner_nvme`)."""
    optim_kept: list[set[int]] = field(default_factory=list)
    """Per stage whose `optim` moves its optimizer data: layers whose data stays on the
    device all the same (`planner_optim_keep`)."""

    def __post_init__(self) -> None:
        self.params = self.params or [set() for _ in self.optim]
        self.grads = self.grads or [set() for _ in self.optim]
        self.host_step = self.host_step or [False for _ in self.optim]
        self.optim_kept = self.optim_kept or [set() for _ in self.optim]

    def copy(self) -> "Draft":
        return Draft([[list(mb) for mb in st] for st in self.layer_tech], list(self.optim), list(self.stash),
                      list(self.stage_to_device), list(self.stripes), dict(self.pool_bytes), list(self.quotas),
                      self.unplaced_bytes, self.unplaced_why, dict(self.recompute_choice),
                      [set(x) for x in self.params], [set(x) for x in self.grads], list(self.host_step), self.drive_full,
                      [set(x) for x in self.optim_kept])

    def moved_optim_bytes(self, s: int, c: StageCosts) -> int:
        """Optimizer data of stage s (costs `c`) that its `optim` technique moves: all of
        it but its kept layers'."""
        return sum(x.optimizer_data_bytes for j, x in enumerate(c.layers) if j not in self.optim_kept[s])

    def choice(self, s: int, j: int) -> int:
        """The recompute choice of layer j of stage s (`WHOLE` unless op-level)."""
        return self.recompute_choice.get((s, j), WHOLE)


class PlanWriter:
    """Turns drafts of one pipeline setup into plans."""

    def __init__(self, setup: PipelineSetup, strategy: Strategy, swap_in_policy: SwapInPolicy,
                 prefetch_lead: int | None = None) -> None:
        self.setup, self.strategy, self.swap_in_policy = setup, strategy, swap_in_policy
        self.prefetch_lead = prefetch_lead
        self.hw: Hardware = setup.hardware
        self.sched = setup.schedule
        self.costs = setup.costs
        self.num_mb = self.sched.num_microbatches
        self._fingerprints: tuple[str, str, str] | None = None  # the setup's: the same in every plan written
        self._last: tuple[Draft, Evaluation | None, Plan] | None = None  # the plan written last, and from what

    def fingerprints(self) -> tuple[str, str, str]:
        """(model, profile, hardware) fingerprints of the setup, hashed once per writer."""
        if self._fingerprints is None:
            self._fingerprints = (self.setup.model.fingerprint(), profile_fingerprint(self.setup),
                                  hardware_fingerprint(self.hw))
        return self._fingerprints

    def to_plan(self, d: Draft, predicted: Evaluation | None = None) -> Plan:
        """The plan the draft describes (`predicted`: its emulation, for the predicted
        peaks, iteration time, program and pinned host bytes). The planner asks for the
        same plan again (its host pins, then why the host cannot hold it): the plan
        written last is given again when the draft equals it and the emulation is the same."""
        last = self._last
        if last is not None and last[1] is predicted and last[0] == d:
            return last[2]
        plan = self._write(d, predicted)
        self._last = (d.copy(), predicted, plan)
        return plan

    def _write(self, d: Draft, predicted: Evaluation | None) -> Plan:
        stages = []
        pinned = pinned_bytes(predicted.schedule, predicted.tensors) if predicted else [0] * len(self.costs)
        for s, c in enumerate(self.costs):
            rules: list[TensorRule] = []
            stripes = [Stripe(device=p, fraction=f) for p, f in (d.stripes[s] if d.stripes else ())]
            if d.optim[s] != KEEP and not d.optim_kept[s]:
                rules.append(self._rule("optim:*", "all", d.optim[s], stripes))
            elif d.optim[s] != KEEP:  # some layers' data stays: a rule per layer that moves
                rules += [self._rule(f"optim:{x.name}", "all", d.optim[s], stripes)
                          for j, x in enumerate(c.layers) if j not in d.optim_kept[s]]
            if d.stash[s] != KEEP:
                rules.append(self._rule("stash:*", "all", d.stash[s], stripes))
            rules += [self._rule(f"{kind}:{c.layers[j].name}", "all", HOST, [])
                      for kind, layers in (("param", d.params[s]), ("grad", d.grads[s])) for j in sorted(layers)]
            lead = None  # the stage's prefetch lead, worked out when a rule first needs it
            for j, layer in enumerate(c.layers):
                by_tech: dict[Technique, list[int]] = {}
                for m, t in enumerate(d.layer_tech[s][j]):
                    if t != KEEP:
                        by_tech.setdefault(t, []).append(m)
                for t, mbs in sorted(by_tech.items()):
                    sel = "all" if len(mbs) == self.num_mb else format_microbatches(mbs)
                    if t == RECOMPUTE and d.choice(s, j) != WHOLE:  # op-level: what it keeps, first
                        recomputed = set(layer.recompute_options[d.choice(s, j)].tensors)
                        rules += [self._rule(x.id, sel, KEEP, stripes) for p, x in enumerate(layer.saved)
                                  if x.op_index >= 0 and p not in recomputed]
                    lead = self._lead(s, d) if lead is None else lead
                    rules.append(self._rule(f"{layer.name}.**", sel, t, stripes, lead))
            peak = predicted.result.peak_bytes[d.stage_to_device[s]] if predicted else 0
            stages.append(StagePlan(
                stage=s, device=d.stage_to_device[s], first_layer=c.first_layer, end_layer=c.end_layer,
                rules=rules, pinned_host_bytes=pinned[s],
                need_bytes=self.setup.memory[s].total_bytes, predicted_peak_bytes=peak,
                optimizer_step="host" if d.host_step[s] else "device",  # type: ignore[arg-type]
            ))
        if predicted is not None and any(predicted.peer_quotas):
            # the quotas the program's D2D slots need (a draft carries none: its evaluation
            # charges the lenders those same pools, `plan_eval.evaluate_plan`)
            stages = with_peer_quotas(stages, predicted.peer_quotas)
        model_fingerprint, profile_print, hardware_print = self.fingerprints()
        return Plan(
            strategy=self.strategy, model=self.setup.model.name, model_fingerprint=model_fingerprint,
            dtype=self.setup.profile.dtype, profile_fingerprint=profile_print, hardware=self.hw.name,
            hardware_fingerprint=hardware_print, num_devices=self.hw.num_devices,
            device_memory_bytes=self.hw.device.memory_bytes, schedule=self.sched.name,  # type: ignore[arg-type]
            num_stages=self.sched.num_stages, num_ranks=self.sched.num_ranks, num_microbatches=self.num_mb,
            microbatch_size=self.setup.microbatch_size, swap_in_policy=self.swap_in_policy,
            stage_to_device=list(d.stage_to_device), stages=stages,
            fits=bool(predicted and predicted.result.fits),
            predicted_iteration_s=predicted.result.iteration_s if predicted else 0.0,
            actions=[format_actions(list(r)) for r in predicted.schedule.ranks] if predicted else [],
        )

    @staticmethod
    def _rule(tensor: str, sel: str, technique: Technique, stripes: list[Stripe], lead: int = 1) -> TensorRule:
        return TensorRule(tensor=tensor, microbatches=sel, technique=technique,
                          stripes=stripes if technique == D2D else [], prefetch_lead=lead)

    def _lead(self, s: int, d: Draft) -> int:
        """Compute actions ahead of the backward at which swap-ins start: enough compute to
        cover bringing one microbatch's swapped bytes back, host swaps over PCIe and D2D
        swaps over the NVLinks to their stripes' peers (or the writer's `prefetch_lead`)."""
        if self.prefetch_lead is not None:
            return self.prefetch_lead
        c = self.costs[s]
        device = d.stage_to_device[s]
        host = sum(c.layers[j].saved_bytes for j in range(len(c.layers)) if HOST in d.layer_tech[s][j])
        d2d = sum(c.layers[j].saved_bytes for j in range(len(c.layers)) if D2D in d.layer_tech[s][j])
        back_s = host / (self.hw.pcie_gbps("h2d") * 1e9)
        nvlink_gbps = sum(self.hw.nvlink_gbps(device, p) for p, _f in (d.stripes[s] if d.stripes else ()))
        if d2d and nvlink_gbps:
            back_s += d2d / (nvlink_gbps * 1e9)
        per_action_s = max(min(c.forward_s, c.backward_s), 1e-9)
        return max(1, min(8, math.ceil(back_s / per_action_s)))
