"""The planner's last step: give a device's spare memory back to its optimizer data.

The fit (`planner.py`, step 2) moves a stage's optimizer states and fp32 master weights
off the device all at once (`optim:*`): it is the candidate with the least overhead per
byte, and the fit takes whole candidates. What is left free at the emulated peak is then
often a layer's worth or more (GPT-20.4B on a DGX A100 under ZB-V: every device peaks at
30.3 of 37.9 GB usable, each layer's optimizer data is 3.8 GB). Streaming that data in
and out around the step is exposed time the schedule cannot hide (the step follows the
last backward), so each layer whose optimizer data stays on the device takes its
round trip off the iteration.

Rounds: per device, the stages on it whose optimizer data goes to the host (not those
that step on the host, which keep no optimizer data on the device at all, nor those on
a drive or a peer) are offered one more layer to keep: the stage's largest streamed
chunk that the device's emulated room (usable memory less its emulated peak) holds,
stages taking turns. All devices' offers are emulated together; the round is kept when
every device fits and the iteration gets faster. Where a device overflows, its offer is
withdrawn and the rest emulated again. The step stops when a round gains nothing or no
device has room. A draft with kept layers writes `optim:LAYER` rules for the layers it
streams, in place of `optim:*` (`plan_draft.PlanWriter`).

Units: bytes, seconds.
"""

from __future__ import annotations

from typing import Any

from mpress.static.memory.stage_costs import StageCosts
from mpress.static.plan.evaluate import Evaluation
from mpress.static.plan.plan_draft import HOST, Draft

FASTER = 1e-3
"""A round is kept when the iteration gets at least this much faster (relative)."""


class OptimizerKeepSteps:
    """`_Planner`'s step that keeps layers' optimizer data on devices with room."""

    costs: list[StageCosts]
    capacity: int
    strategy: str
    options: Any  # the planner's PlannerOptions

    def evaluate(self, d: Draft) -> Evaluation:  # implemented by the planner
        raise NotImplementedError

    def progress(self, message: str) -> None:  # implemented by the planner
        raise NotImplementedError

    def _streamed(self, d: Draft, s: int) -> dict[int, int]:
        """Layers of stage s whose optimizer data the draft streams to the host, with
        their data's bytes."""
        if d.optim[s] != HOST or d.host_step[s]:
            return {}
        sizes = {j: x.optimizer_data_bytes for j, x in enumerate(self.costs[s].layers)}
        return {j: n for j, n in sizes.items() if j not in d.optim_kept[s] and n > 0}

    def _offers(self, d: Draft, ev: Evaluation) -> dict[int, tuple[int, int]]:
        """Per device with room: (stage, layer) whose optimizer data to keep next."""
        offers: dict[int, tuple[int, int]] = {}
        for dev, peak in enumerate(ev.result.peak_bytes):
            room = self.capacity - peak
            streamed = {s: self._streamed(d, s) for s, x in enumerate(d.stage_to_device) if x == dev}
            # the stage keeping the fewest layers first, then the largest chunk that fits
            for s in sorted(streamed, key=lambda s: (len(d.optim_kept[s]), s)):
                fitting = [(n, j) for j, n in streamed[s].items() if n <= room]
                if fitting:
                    offers[dev] = (s, max(fitting)[1])
                    break
        return offers

    def _keep_optimizer_layers(self, d: Draft, ev: Evaluation) -> tuple[Draft, Evaluation]:
        """Keep layers' optimizer data on the devices while the emulated iteration gets
        faster and every device fits (see the module's docstring)."""
        if not ev.result.fits or not self.options.optimizer_keep:
            return d, ev
        for rnd in range(1, sum(len(c.layers) for c in self.costs) + 1):
            offers = self._offers(d, ev)
            cand = None
            while offers:
                trial = d.copy()
                for s, j in offers.values():
                    trial.optim_kept[s].add(j)
                cand = self.evaluate(trial)
                over = {dev for dev in offers if cand.result.oom[dev]}
                if not over:
                    break
                offers = {dev: o for dev, o in offers.items() if dev not in over}
                cand = None
            faster = cand is not None and cand.result.fits and \
                cand.result.iteration_s < ev.result.iteration_s * (1 - FASTER)
            if cand is not None:
                self.progress(f"{self.strategy}: optimizer round {rnd}: {len(offers)} layers' "
                              f"optimizer data kept on their devices, {cand.result.iteration_s:.3f} s "
                              f"({'kept' if faster else 'no gain, stop'})")
            if not faster:
                break
            d, ev = trial, cand
        return d, ev
